//! Tensor parallelism through the real binaries: one coordinator and a group per tp
//! degree (1, 2 and 4 shard processes over shared memory) for each f32 fixture model;
//! greedy tokens must equal transformers' (`expected.json`) at every tp. Logits are
//! compared within 1e-4 in-process (crates/model/tests/tensor_parallel.rs); here the
//! whole path — registration, assignment, collectives, plans, sampling on rank 0 — runs.
//! The demo model (SmolLM2, 9 heads, 3 KV heads) must give the same tokens at tp = 3
//! as at tp = 1.

use tessera_tests::{Cluster, GroupSpec, demo_model, f32_greedy, fixture};

fn same_tokens_at_every_tp(model: &str) {
    let expected = f32_greedy(model);
    let path = fixture(&format!("{model}/f32"));
    let tps = [1, 2, 4];
    let groups: Vec<GroupSpec> = tps
        .iter()
        .map(|tp| GroupSpec::local(&format!("tp{tp}"), &format!("m{tp}"), &path, *tp))
        .collect();
    let cluster = Cluster::start_local(&groups).expect("the cluster starts");
    for (prompt, want) in &expected {
        for tp in tps {
            let got = cluster
                .greedy(&format!("m{tp}"), prompt, want.len())
                .unwrap_or_else(|e| panic!("{model} tp = {tp}: {e:#}"));
            assert_eq!(
                &got,
                want,
                "{model} at tp = {tp}, prompt of {} tokens: tokens differ from transformers\n{}",
                prompt.len(),
                cluster.logs()
            );
        }
    }
}

#[test]
fn llama_gqa() {
    same_tokens_at_every_tp("llama-gqa");
}

#[test]
fn llama3_rope() {
    same_tokens_at_every_tp("llama3-rope");
}

#[test]
fn mistral() {
    same_tokens_at_every_tp("mistral");
}

#[test]
fn qwen2_bias_tied() {
    same_tokens_at_every_tp("qwen2-bias-tied");
}

#[test]
fn qwen3() {
    same_tokens_at_every_tp("qwen3");
}

/// Gemma 2: a sliding window through the shards' paged cache, soft caps, post-norms.
#[test]
fn gemma2() {
    same_tokens_at_every_tp("gemma2");
}

/// Phi-3: fused q|k|v and gate|up split per rank at load, LongRoPE (short factors for the
/// prompts that stay within 32 positions, long ones for those past it), a sliding window
/// on every layer.
#[test]
fn phi3() {
    same_tokens_at_every_tp("phi3");
}

#[test]
fn smollm2_tp3_matches_tp1() {
    let Some(path) = demo_model() else { return };
    let groups = [
        GroupSpec::local("tp1", "smol1", &path, 1),
        GroupSpec::local("tp3", "smol3", &path, 3),
    ];
    let cluster = Cluster::start_local(&groups).expect("the cluster starts");
    // "The capital of France is" in SmolLM2's vocabulary, with a chat-free raw prompt.
    let body = |model: &str| {
        serde_json::json!({
            "model": model, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0, "return_token_ids": true,
        })
    };
    let (s1, a1) = cluster.complete(&body("smol1")).expect("tp = 1 answers");
    let (s3, a3) = cluster.complete(&body("smol3")).expect("tp = 3 answers");
    assert_eq!((s1, s3), (200, 200), "{a1}\n{a3}\n{}", cluster.logs());
    assert_eq!(
        a1["choices"][0]["token_ids"], a3["choices"][0]["token_ids"],
        "SmolLM2 tp = 3 must generate what tp = 1 does\n{a1}\n{a3}"
    );
    assert_eq!(a1["choices"][0]["text"], a3["choices"][0]["text"]);
    assert!(
        a1["choices"][0]["text"]
            .as_str()
            .unwrap_or("")
            .contains("Paris"),
        "SmolLM2 should know: {a1}"
    );
}

/// The cores the threads of process `pid` may run on, one list per thread that may run
/// on exactly one (`Cpus_allowed_list` of each task).
fn pinned_threads(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .filter_map(|status| {
            let line = status
                .lines()
                .find(|l| l.starts_with("Cpus_allowed_list:"))?;
            let list = line.split_whitespace().nth(1)?.to_string();
            (!list.contains([',', '-'])).then_some(list)
        })
        .collect()
}

/// Two one-thread shards of a group on this host, which has at least 2 cores: each rank's
/// compute thread runs on a core of its own (the shard pins it), and not the other's.
#[test]
fn each_ranks_compute_thread_runs_on_a_core_of_its_own() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if cores < 2 {
        eprintln!("SKIPPED: one core: nothing to pin apart");
        return;
    }
    let groups = [GroupSpec::local("p", "m", &fixture("llama-gqa/f32"), 2)];
    // The harness turns pinning off for test clusters; this one keeps it.
    let pin = [("TESSERA_PIN_THREADS", "1")];
    let mut cluster = Cluster::start_local_with(&groups, &pin).expect("the cluster starts");
    let pinned: Vec<Vec<String>> = ["p-0", "p-1"]
        .iter()
        .map(|name| pinned_threads(cluster.proc(name).child.id()))
        .collect();
    assert!(
        pinned.iter().all(|p| p.len() == 1) && pinned[0] != pinned[1],
        "one pinned thread per rank, on different cores: {pinned:?}\n{}",
        cluster.logs()
    );
}
