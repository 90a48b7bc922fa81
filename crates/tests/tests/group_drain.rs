//! A group's maintenance drain (issue 19, item 2), on real processes: three coordinator
//! peers and two groups of one model, whose steps are slow (40 ms).
//! - `tessera group drain a` while streams run on both groups: the command returns once
//!   group `a` is idle, every stream ends by length, and from then on group `a` takes no
//!   new request while `b` serves them;
//! - the drain is replicated: after the leader is killed, the new leader keeps `a` out;
//! - `tessera group resume a` puts it back; with both groups drained a request gets 503
//!   saying so; an unknown group is a 400 naming it, and an inference key gets 403.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_tests::failover::{kill_leader, wait_for_leader};
use tessera_tests::{Cluster, GroupSpec, TEST_ADMIN_KEY, bin, fixture, get, post, sse, wait_ready};

const TOKENS: usize = 24;

fn stream_body(prompt: u32) -> Value {
    json!({
        "model": "m", "prompt": [prompt, 8, 2, 6], "max_tokens": TOKENS,
        "temperature": 0, "ignore_eos": true, "stream": true,
    })
}

/// Group `name`'s status in `url`'s `/v1/cluster`.
fn group(url: &str, name: &str) -> Value {
    let (status, cluster) = get(&format!("{url}/v1/cluster")).expect("GET /v1/cluster");
    assert_eq!(status, 200, "{cluster}");
    cluster["groups"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["name"] == name).cloned())
        .unwrap_or_else(|| panic!("group {name} in {cluster}"))
}

/// `tessera group ARGS --url URL --admin-key …`: its exit status and stderr.
fn tessera_group(url: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("tessera"))
        .arg("group")
        .args(args)
        .args(["--url", url, "--admin-key", TEST_ADMIN_KEY])
        .output()
        .expect("tessera group runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs a stream on `url` while `check` is called until it ends: the stream's finish
/// reason and whether `check` ever saw group `name` running it.
fn stream_seen_on(url: &str, prompt: u32, name: &str) -> (Option<String>, bool) {
    let target = format!("{url}/v1/completions");
    let run = std::thread::spawn(move || sse(&target, Some(&stream_body(prompt)), None));
    let mut seen = false;
    while !run.is_finished() {
        seen |= group(url, name)["running"].as_u64().unwrap_or(0) > 0;
        std::thread::sleep(Duration::from_millis(20));
    }
    let (events, done) = run.join().expect("stream thread");
    assert!(done, "the stream ended with [DONE]");
    let reason = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from))
        .next_back();
    (reason, seen)
}

#[test]
fn a_drained_group_finishes_its_streams_then_takes_nothing_even_after_a_failover() {
    let path = fixture("llama-gqa/f32");
    let groups = [
        GroupSpec::local("a", "m", &path, 1),
        GroupSpec::local("b", "m", &path, 1),
    ];
    let (mut cluster, urls) =
        Cluster::start_local_peers(3, &groups, &[("TESSERA_FAULT_STEP_DELAY_MS", "40")])
            .expect("cluster starts");
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    let url = all[0];
    wait_ready(url, Duration::from_secs(60), || cluster.logs());

    // Streams on both groups (different prompts spread over them), then the drain.
    let streams: Vec<_> = (0..6u32)
        .map(|i| {
            let target = format!("{url}/v1/completions");
            std::thread::spawn(move || sse(&target, Some(&stream_body(10 + i * 7)), None))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while group(url, "a")["running"] == 0 {
        assert!(Instant::now() < deadline, "no stream reached group a");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, said) = tessera_group(all[1], &["drain", "a"]);
    assert!(ok, "tessera group drain: {said}\n{}", cluster.logs());
    assert!(said.contains("group a is idle"), "{said}");
    let a = group(url, "a");
    assert_eq!(
        (a["drained"].clone(), a["running"].clone()),
        (json!(true), json!(0))
    );
    for s in streams {
        let (events, done) = s.join().expect("stream thread");
        assert!(done, "a stream was cut by the drain");
        let last = events.iter().rev().find_map(|e| {
            let v: Value = serde_json::from_str(&e.data).ok()?;
            v["choices"][0]["finish_reason"].as_str().map(String::from)
        });
        assert_eq!(last.as_deref(), Some("length"));
    }

    // New requests go to b only; so after the leader dies, on the new leader.
    let (reason, on_a) = stream_seen_on(url, 3, "a");
    assert_eq!(reason.as_deref(), Some("length"));
    assert!(!on_a, "a drained group ran a new request");
    let leader = wait_for_leader(&all, None, Duration::from_secs(10));
    let others = kill_leader(&mut cluster, &all, leader);
    let url = others[0];
    wait_ready(url, Duration::from_secs(60), || cluster.logs());
    assert_eq!(
        group(url, "a")["drained"],
        true,
        "the new leader keeps a drained"
    );
    for prompt in [4, 5] {
        let (reason, on_a) = stream_seen_on(url, prompt, "a");
        assert_eq!(reason.as_deref(), Some("length"));
        assert!(!on_a, "group a ran a request after the failover");
    }

    // Both drained: refused with what to do; resumed: a serves again.
    let (ok, said) = tessera_group(url, &["drain", "b", "--no-wait"]);
    assert!(ok, "{said}");
    let plain = json!({"model": "m", "prompt": [1, 2], "max_tokens": 2});
    let (status, answer) = post(&format!("{url}/v1/completions"), &plain).expect("post");
    assert_eq!(status, 503, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("drained") && message.contains("tessera group resume"),
        "{message}"
    );
    for name in ["a", "b"] {
        let (ok, said) = tessera_group(url, &["resume", name]);
        assert!(ok, "{said}");
        assert_eq!(group(url, name)["drained"], false);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, on_a) = stream_seen_on(url, 9, "a");
        if on_a {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "group a took no request once resumed"
        );
    }

    // Bad input: an unknown group, an inference key.
    let (ok, said) = tessera_group(url, &["drain", "nope"]);
    assert!(
        !ok && said.contains("group `nope` is not in the topology"),
        "{said}"
    );
    let drain_a = format!("{url}/v1/cluster/groups/a/drain");
    let (status, answer) = post(&drain_a, &json!({})).expect("post");
    assert_eq!(status, 403, "an inference key drains nothing: {answer}");
    assert_eq!(group(url, "a")["drained"], false);
}
