//! A one-rank NCCL group on a GPU (`scripts/gpu-check.sh` runs this): every collective
//! completes within its deadline with the values a group of one must give. Without a CUDA
//! driver or NCCL the test says so and passes, unless `TESSERA_REQUIRE_GPU=1`.

use std::time::Duration;

use cudarc::driver::CudaContext;
use tessera_comm::Collective;
use tessera_comm::nccl::{NcclGroup, nccl_present, unique_id};
use tessera_topology::Rank;

#[test]
fn a_one_rank_group_reduces_gathers_and_broadcasts() {
    // SAFETY: only tries to dlopen the driver's candidate names.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver || !nccl_present() {
        assert!(
            std::env::var("TESSERA_REQUIRE_GPU").as_deref() != Ok("1"),
            "TESSERA_REQUIRE_GPU=1 but the CUDA driver ({driver}) or NCCL ({}) is missing",
            nccl_present()
        );
        eprintln!("SKIPPED: no CUDA driver or no NCCL");
        return;
    }
    let ctx = CudaContext::new(0).expect("device 0");
    let stream = ctx.default_stream();
    let id = unique_id().expect("a unique id");
    let mut group =
        NcclGroup::join(stream.clone(), Rank(0), 1, &id, Duration::from_secs(5)).expect("join");
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let mut buf = stream.clone_htod(&values).expect("upload");
    group.all_reduce_sum(&mut buf).expect("all-reduce");
    group.broadcast(&mut buf, Rank(0)).expect("broadcast");
    let mut gathered = stream.alloc_zeros::<f32>(values.len()).expect("alloc");
    group.all_gather(&buf, &mut gathered).expect("all-gather");
    assert_eq!(stream.clone_dtoh(&gathered).expect("download"), values);
    let mut wrong = stream.alloc_zeros::<f32>(values.len() + 1).expect("alloc");
    assert!(group.all_gather(&buf, &mut wrong).is_err());
    // The host-memory path (the `Collective` trait), as a shard's engine uses it.
    assert_eq!(group.stats().calls, 3, "the device calls are counted");
    let comm: &mut dyn Collective = &mut group;
    let mut host = values.clone();
    comm.all_reduce_sum(&mut host).expect("host all-reduce");
    assert_eq!(host, values);
    let mut bytes = b"sampled tokens".to_vec();
    comm.broadcast(&mut bytes, Rank(0)).expect("host broadcast");
    assert_eq!(bytes, b"sampled tokens");
    let mut out = vec![0.0; values.len()];
    comm.all_gather(&values, &mut out).expect("host all-gather");
    assert_eq!(out, values);
    comm.barrier().expect("barrier");
    assert_eq!(comm.stats().calls, 7);
    eprintln!(
        "one-rank NCCL group: all-reduce, broadcast and all-gather of 1000 values ok, on the device and through the host"
    );
}
