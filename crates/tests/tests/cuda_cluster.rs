//! A real cluster with shards on `cuda:0` (`scripts/gpu-check.sh` runs this on a GPU): the
//! coordinator, a CPU group, a GPU group (tp = 1) and a tp = 2 group with both shards on
//! the same GPU through the CPU collective (shared memory), all serving the same fixture
//! model; the GPU groups' greedy tokens compared with the CPU shard's and transformers',
//! and the first request after `/ready` (the GPU groups warmed up) with the steady state.
//! Without a CUDA driver the test says so and passes, unless `TESSERA_REQUIRE_GPU=1`.

use std::time::Duration;

use tessera_kernels::cuda::device::driver_present;
use tessera_tests::{
    Cluster, GroupSpec, f32_greedy, first_and_steady_latency, fixture, free_port, metric,
    topology_text,
};

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
        GroupSpec::local("gpu2", "m-gpu2", &path, 2),
    ];
    let (quic, http) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let text = topology_text("local", &quic, &http, &[("local", "127.0.0.1")], &groups);
    // Every shard after the CPU group's runs on cuda:0 (the groups' collective is shared
    // memory, so they may share the GPU).
    let at = text.find("name = \"gpu\"").expect("the gpu group");
    let text = format!(
        "{}{}",
        &text[..at],
        text[at..].replace("device = \"cpu\"", "device = \"cuda:0\"")
    );
    let mut cluster = Cluster::prepare(&text, &http).expect("topology and certificates");
    cluster.start_coordinator().expect("coordinator");
    cluster.start_shard("cpu", 0).expect("cpu shard");
    cluster.start_shard("gpu", 0).expect("gpu shard");
    cluster.start_shard("gpu2", 0).expect("gpu2 shard 0");
    cluster.start_shard("gpu2", 1).expect("gpu2 shard 1");
    cluster
        .wait_healthy(Duration::from_secs(60))
        .expect("coordinator healthy");
    // The GPU groups warm up before `/ready` (`--warmup auto`): the first request after it
    // pays for no graph capture or first use.
    cluster.wait_ready(Duration::from_secs(180));
    let (first, steady) = first_and_steady_latency(&cluster.http, "m-gpu", 32);
    let ratio = first.as_secs_f64() / steady.as_secs_f64();
    eprintln!("m-gpu: first request after /ready {first:?}, steady state {steady:?} ({ratio:.2}×)");
    assert!(
        ratio <= 1.5,
        "the first request after /ready took {ratio:.2}× the steady state's {steady:?}\n{}",
        cluster.logs()
    );
    for group in ["gpu", "gpu2"] {
        let labels = format!("group=\"{group}\"");
        let warmup = metric(&cluster.http, "tessera_shard_warmup_seconds", &labels);
        assert!(
            warmup.expect("metrics") > 0.0,
            "{group}'s shards warmed up\n{}",
            cluster.logs()
        );
    }
    let cpu_warmup = metric(
        &cluster.http,
        "tessera_shard_warmup_seconds",
        "group=\"cpu\"",
    );
    assert_eq!(
        cpu_warmup.expect("metrics"),
        0.0,
        "auto skips a CPU group's warmup"
    );
    for model in ["m-gpu", "m-gpu2"] {
        let (mut same, mut total) = (0, 0);
        for (prompt, want) in f32_greedy("llama-gqa") {
            let cpu = cluster
                .greedy("m-cpu", &prompt, want.len())
                .expect("cpu answer");
            let gpu = cluster
                .greedy(model, &prompt, want.len())
                .expect("gpu answer");
            assert_eq!(cpu, want, "the CPU shard gives transformers' tokens");
            let common = gpu.iter().zip(&want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "{model}, prompt {prompt:?}: follows transformers for {common} of {} tokens",
                want.len()
            );
            same += common;
            total += want.len();
        }
        // bf16 GEMMs may flip a near-tie, after which greedy text may part ways.
        assert!(
            same * 10 >= total * 8,
            "{model} follows for {same} of {total} tokens\n{}",
            cluster.logs()
        );
    }
    let logs = cluster.logs();
    assert!(logs.contains("model slice on the device"), "{logs}");
}
