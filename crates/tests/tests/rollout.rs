//! Model versions and rollouts (issue 19, item 3), on real processes: one coordinator and
//! two groups (`a`, `b`) of model `m`, whose version 1 is the f32 fixture.
//! - `tessera model deploy --canary 25 --groups b` with the bf16 fixture as version 2:
//!   `b` loads it while `a` serves, then 200 requests split 25% ± 5% by their
//!   `x-tessera-model-version`; `promote` moves `a` too, `rollback` returns both to 1;
//!   bad deploys are 400s that change nothing, an inference key gets 403.
//! - A canary planted to fail at step time (its directory holds the file that
//!   `TESSERA_FAULT_STEP_ERROR_FILE` names) is rolled back automatically once its error
//!   rate passes 1% over the window: requests fail only before the rollback, and every
//!   one after it succeeds on version 1.
//! - The versions are replicated: with three peers, the leader killed while a canary runs,
//!   the new leader keeps the canary (its group still on version 2, the split the same)
//!   and can promote it.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_tests::failover::{kill_leader, wait_for_leader};
use tessera_tests::{
    Cluster, GroupSpec, TEST_ADMIN_KEY, TEST_API_KEY, bin, fixture, get, metric, post, wait_ready,
};

const PLANTED: &str = "TESSERA_PLANTED_FAULT";

/// A one-host cluster of `peers` coordinator peers (with `coordinator_env`) and groups
/// `a` and `b` (with `shard_env`), ready; the peers' URLs.
fn start(
    peers: usize,
    coordinator_env: &[(&str, &str)],
    shard_env: &[(&str, &str)],
) -> (Cluster, Vec<String>) {
    let path = fixture("llama-gqa/f32");
    let groups = [
        GroupSpec::local("a", "m", &path, 1),
        GroupSpec::local("b", "m", &path, 1),
    ];
    let (cluster, urls) =
        Cluster::start_local_peers_with(peers, &groups, shard_env, coordinator_env)
            .expect("cluster starts");
    wait_ready(&urls[0], Duration::from_secs(60), || cluster.logs());
    (cluster, urls)
}

/// One greedy completion: its status and the version its header names.
fn complete(url: &str) -> (u16, Option<u32>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let body = json!({"model": "m", "prompt": [1, 5, 9], "max_tokens": 2, "temperature": 0});
    let response = agent
        .post(format!("{url}/v1/completions"))
        .header("Authorization", &format!("Bearer {TEST_API_KEY}"))
        .send_json(&body)
        .expect("POST /v1/completions");
    let version = response
        .headers()
        .get("x-tessera-model-version")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    (response.status().as_u16(), version)
}

/// `tessera model ARGS --url URL --admin-key …`: its exit status and stderr + stdout.
fn tessera_model(url: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("tessera"))
        .arg("model")
        .args(args)
        .args(["--url", url, "--admin-key", TEST_ADMIN_KEY])
        .output()
        .expect("tessera model runs");
    let mut said = String::from_utf8_lossy(&out.stderr).into_owned();
    said.push_str(&String::from_utf8_lossy(&out.stdout));
    (out.status.success(), said)
}

/// The model's versions as `tessera model status` reads them (with the admin key).
fn versions(url: &str) -> Value {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    agent
        .get(format!("{url}/v1/cluster/models/m"))
        .header("Authorization", &format!("Bearer {TEST_ADMIN_KEY}"))
        .call()
        .expect("GET the model's versions")
        .body_mut()
        .read_json()
        .expect("JSON")
}

/// How many of `n` requests each version served (all must succeed).
fn served(url: &str, n: usize) -> [usize; 3] {
    let mut by_version = [0; 3];
    for _ in 0..n {
        let (status, version) = complete(url);
        assert_eq!(status, 200);
        by_version[version.expect("a version header") as usize] += 1;
    }
    by_version
}

#[test]
fn a_canary_gets_its_share_then_promote_and_rollback_move_every_group() {
    // No automatic verdict here: on these tiny models the bf16 version's TTFT p99 can
    // pass 1.5× the f32 one's, and that rollback is the other test's subject.
    let (cluster, urls) = start(1, &[("TESSERA_CANARY_MIN_REQUESTS", "1000000")], &[]);
    let url = urls[0].clone();
    let v2 = fixture("llama-gqa/bf16");
    let v2 = v2.to_str().unwrap();
    assert_eq!(served(&url, 4), [0, 4, 0], "version 1 serves at first");

    // Bad deploys: 400 with what to change, and nothing changes.
    let deploy = format!("{url}/v1/cluster/models/m/deploy");
    let admin = |body: &Value| {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut response = agent
            .post(&deploy)
            .header("Authorization", &format!("Bearer {TEST_ADMIN_KEY}"))
            .send_json(body)
            .expect("POST deploy");
        let status = response.status().as_u16();
        let answer: Value = response.body_mut().read_json().expect("JSON");
        (status, answer)
    };
    let cases = [
        (
            json!({"path": "/no/such/model"}),
            "`/no/such/model` cannot be deployed",
        ),
        (
            json!({"path": v2, "canary_percent": 150}),
            "0 to 100 percent, not 150",
        ),
        (
            json!({"path": v2, "canary_percent": 5, "groups": ["zz"]}),
            "group `zz` does not serve",
        ),
        (
            json!({"path": v2, "canary_percent": 5, "groups": ["a", "b"]}),
            "leaves none to serve",
        ),
    ];
    for (body, expected) in cases {
        let (status, answer) = admin(&body);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(message.contains(expected), "{body}: {message}");
    }
    let (status, _) = post(&deploy, &json!({"path": v2})).expect("post");
    assert_eq!(status, 403, "an inference key deploys nothing");
    assert_eq!(versions(&url)["versions"].as_array().map(Vec::len), Some(1));

    let (ok, said) = tessera_model(
        &url,
        &[
            "deploy", "m", "--path", v2, "--canary", "25", "--groups", "b",
        ],
    );
    assert!(ok, "deploy: {said}\n{}", cluster.logs());
    assert!(
        said.contains("every group of m serves its version"),
        "{said}"
    );
    let status = versions(&url);
    assert_eq!(status["canary"]["version"], 2, "{status}");
    let split = served(&url, 200);
    assert!(
        (40..=60).contains(&split[2]),
        "25% ± 5% of 200 requests on the canary, got {split:?}"
    );

    // Two rollouts of one model at once: the second is refused.
    let (ok, said) = tessera_model(&url, &["deploy", "m", "--path", v2]);
    assert!(
        !ok && said.contains("version 2 is still a canary"),
        "{said}"
    );
    assert_eq!(versions(&url)["versions"].as_array().map(Vec::len), Some(2));

    let (ok, said) = tessera_model(&url, &["promote", "m"]);
    assert!(ok, "promote: {said}\n{}", cluster.logs());
    assert_eq!(
        served(&url, 20),
        [0, 0, 20],
        "promoted: version 2 everywhere"
    );
    let (ok, said) = tessera_model(&url, &["rollback", "m"]);
    assert!(ok, "rollback: {said}\n{}", cluster.logs());
    assert_eq!(
        served(&url, 20),
        [0, 20, 0],
        "rolled back: version 1 everywhere"
    );
    let (ok, said) = tessera_model(&url, &["status", "m"]);
    assert!(
        ok && said.contains("stable version 1 (previous 2)"),
        "{said}"
    );
    assert!(said.contains("rolled back to version 1"), "{said}");
}

#[test]
fn a_canary_planted_to_fail_is_rolled_back_automatically() {
    // Version 2: the f32 fixture again, with the planted file beside it.
    let dir = tempfile::tempdir().expect("temp dir");
    let v2 = dir.path().join("m-v2");
    std::fs::create_dir(&v2).unwrap();
    for entry in std::fs::read_dir(fixture("llama-gqa/f32")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), v2.join(entry.file_name())).unwrap();
    }
    std::fs::write(v2.join(PLANTED), "every step of this version fails\n").unwrap();
    let coordinator_env = [
        ("TESSERA_CANARY_WINDOW", "30"),
        ("TESSERA_CANARY_MIN_REQUESTS", "5"),
    ];
    let shard_env = [("TESSERA_FAULT_STEP_ERROR_FILE", PLANTED)];
    let (cluster, urls) = start(1, &coordinator_env, &shard_env);
    let url = urls[0].clone();
    let v2 = v2.to_str().unwrap();
    let (ok, said) = tessera_model(
        &url,
        &[
            "deploy", "m", "--path", v2, "--canary", "50", "--groups", "b",
        ],
    );
    assert!(ok, "deploy: {said}\n{}", cluster.logs());

    // Requests one after another: the canary's fail until it is rolled back.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut failed = 0;
    let rolled_back = loop {
        assert!(
            Instant::now() < deadline,
            "no rollback within 60 s\n{}",
            cluster.logs()
        );
        let (status, _) = complete(&url);
        if status != 200 {
            failed += 1;
        }
        if versions(&url)["canary"].is_null() {
            break Instant::now();
        }
    };
    assert!(
        failed >= 5,
        "the verdict needs 5 of the canary's requests: {failed} failed"
    );
    let status = versions(&url);
    let last = status["events"].as_array().and_then(|e| e.last()).cloned();
    let what = last
        .as_ref()
        .and_then(|e| e["what"].as_str())
        .unwrap_or_default();
    assert!(
        what.contains("rolled back (automatic: error rate")
            && what.contains("passed the limit of 1%"),
        "{status}"
    );
    let rollbacks = metric(&url, "tessera_model_rollbacks_total", "cause=\"automatic\"").unwrap();
    assert_eq!(rollbacks, 1.0);
    // From the rollback on, nothing is lost: group b returns to version 1.
    assert_eq!(
        served(&url, 30),
        [0, 30, 0],
        "after the rollback (at {rolled_back:?})"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !versions(&url)["groups"]
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g["version"] == 1)
    {
        assert!(
            Instant::now() < deadline,
            "b never returned to version 1\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(served(&url, 10), [0, 10, 0]);
    let (_, cluster_status) = get(&format!("{url}/v1/cluster")).expect("GET /v1/cluster");
    let events = &cluster_status["models"][0]["events"];
    assert!(
        events.to_string().contains("automatic"),
        "the status page shows it: {events}"
    );
}

#[test]
fn a_new_leader_keeps_the_canary_and_promotes_it() {
    // No automatic verdict: this test is about replication.
    let env = [("TESSERA_CANARY_MIN_REQUESTS", "1000000")];
    let (mut cluster, urls) = start(3, &env, &[]);
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    let v2 = fixture("llama-gqa/bf16");
    let v2 = v2.to_str().unwrap();
    // Through a follower, which forwards it to the leader.
    let leader = wait_for_leader(&all, None, Duration::from_secs(10));
    let follower = all[if leader == 1 { 1 } else { 0 }];
    let (ok, said) = tessera_model(
        follower,
        &[
            "deploy", "m", "--path", v2, "--canary", "50", "--groups", "b",
        ],
    );
    assert!(ok, "deploy: {said}\n{}", cluster.logs());

    let others = kill_leader(&mut cluster, &all, leader);
    let url = others[0];
    wait_ready(url, Duration::from_secs(60), || cluster.logs());
    let status = versions(url);
    assert_eq!(
        status["canary"]["version"], 2,
        "the canary survives: {status}"
    );
    let b = status["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "b")
        .cloned();
    assert_eq!(b.map(|g| g["version"].clone()), Some(json!(2)), "{status}");
    let split = served(url, 40);
    assert_eq!(split, [0, 20, 20], "the new leader splits 50/50");

    let (ok, said) = tessera_model(url, &["promote", "m"]);
    assert!(ok, "promote on the new leader: {said}\n{}", cluster.logs());
    assert_eq!(served(url, 10), [0, 0, 10]);
}
