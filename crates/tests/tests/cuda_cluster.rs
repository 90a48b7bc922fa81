//! A real cluster with a shard on `cuda:0` (`scripts/gpu-check.sh` runs this on a GPU):
//! the coordinator, a CPU group and a GPU group serving the same fixture model, the GPU
//! shard's greedy tokens compared with the CPU shard's and with transformers'. Without a
//! CUDA driver the test says so and passes, unless `TESSERA_REQUIRE_GPU=1`.

use std::time::Duration;

use tessera_kernels::cuda::device::driver_present;
use tessera_tests::{Cluster, GroupSpec, f32_greedy, fixture, free_port, topology_text};

#[test]
fn a_cuda_shard_serves_the_tokens_a_cpu_shard_does() {
    if !driver_present() {
        assert!(
            std::env::var("TESSERA_REQUIRE_GPU").as_deref() != Ok("1"),
            "TESSERA_REQUIRE_GPU=1 but there is no CUDA driver"
        );
        eprintln!("SKIPPED: no CUDA driver");
        return;
    }
    let path = fixture("llama-gqa/f32");
    let groups = [
        GroupSpec::local("cpu", "m-cpu", &path, 1),
        GroupSpec::local("gpu", "m-gpu", &path, 1),
    ];
    let (quic, http) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let text = topology_text("local", &quic, &http, &[("local", "127.0.0.1")], &groups);
    // The GPU group's shard (the second) runs on cuda:0.
    let at = text.find("name = \"gpu\"").expect("the gpu group");
    let text = format!(
        "{}{}",
        &text[..at],
        text[at..].replacen("device = \"cpu\"", "device = \"cuda:0\"", 1)
    );
    let mut cluster = Cluster::prepare(&text, &http).expect("topology and certificates");
    cluster.start_coordinator().expect("coordinator");
    cluster.start_shard("cpu", 0).expect("cpu shard");
    cluster.start_shard("gpu", 0).expect("gpu shard");
    cluster
        .wait_healthy(Duration::from_secs(60))
        .expect("coordinator healthy");
    let (mut same, mut total) = (0, 0);
    for (prompt, want) in f32_greedy("llama-gqa") {
        let cpu = cluster
            .greedy("m-cpu", &prompt, want.len())
            .expect("cpu answer");
        let gpu = cluster
            .greedy("m-gpu", &prompt, want.len())
            .expect("gpu answer");
        assert_eq!(cpu, want, "the CPU shard gives transformers' tokens");
        let common = gpu.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "prompt {prompt:?}: the GPU shard follows transformers for {common} of {} tokens",
            want.len()
        );
        same += common;
        total += want.len();
    }
    // bf16 GEMMs may flip a near-tie, after which greedy text may part ways.
    assert!(
        same * 10 >= total * 8,
        "the GPU shard follows for {same} of {total} tokens\n{}",
        cluster.logs()
    );
    let logs = cluster.logs();
    assert!(logs.contains("model slice on the device"), "{logs}");
}
