//! `tessera topology apply` (issue 19, item 3), on real processes: one coordinator and
//! group `a` of model `m` (the f32 fixture).
//! - Bad applies are refused with a 400 that says what to change, and change nothing: a
//!   file that does not parse, a relative path, group `a` moved to other ports, model
//!   `m` pointed at other files; an inference key gets 403.
//! - Applying a second file adds group `b` (model `m`, tp 2, slow steps) and group `c` of
//!   a new model `n` (the bf16 fixture); their shards, started with it, serve, while `a`
//!   runs on untouched (same process, same epoch).
//! - Applying the first file again, with a stream running on `b`, drains `b` first: the
//!   stream ends by length, then `b`'s and `c`'s shards exit cleanly, and model `n` is no
//!   longer served; `a` serves on.
//! - The applied topology is replicated: with three peers, applied through a follower,
//!   the leader killed, the new leader runs group `b` too, and a peer restarted from its
//!   (first) file follows the applied topology, not its file.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_comm::certs::{Identity, issue_one};
use tessera_tests::failover::{kill_leader, wait_for_leader};
use tessera_tests::{
    Cluster, GroupSpec, TEST_ADMIN_KEY, TEST_API_KEY, bin, fixture, free_port, get, get_as, post,
    sse, wait_ready,
};
use tessera_topology::Rank;

/// `POST url` with `key`: the status and the JSON answer.
fn post_as(key: &str, url: &str, body: &Value) -> (u16, Value) {
    tessera_tests::post_as(key, url, body, &[]).expect("POST")
}

/// `POST /v1/cluster/topology` with the admin key.
fn apply_text(url: &str, path: &Path, text: &str) -> (u16, Value) {
    let body = json!({"path": path, "text": text});
    post_as(TEST_ADMIN_KEY, &format!("{url}/v1/cluster/topology"), &body)
}

/// `tessera topology apply FILE --url URL --admin-key … ARGS`: success, and its stderr.
fn tessera_apply(url: &str, file: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("tessera"))
        .args(["topology", "apply"])
        .arg(file)
        .args([
            "--url",
            url,
            "--admin-key",
            TEST_ADMIN_KEY,
            "--timeout",
            "120",
        ])
        .args(args)
        .output()
        .expect("tessera topology apply runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `[[group]]` of `tp` cpu ranks on host `local`, each on a free port.
fn group_text(name: &str, model: &str, tp: usize) -> String {
    let mut t = format!("[[group]]\nname = \"{name}\"\nmodel = \"{model}\"\ntp = {tp}\n\n");
    for rank in 0..tp {
        let port = free_port();
        let _ = write!(
            t,
            "[[group.shard]]\nrank = {rank}\nhost = \"local\"\ndevice = \"cpu\"\nthreads = 1\n\
             port = {port}\nkv_memory = \"16MiB\"\n\n"
        );
    }
    t
}

/// The groups of `/v1/cluster`.
fn groups(url: &str) -> Vec<Value> {
    let (status, cluster) = get(&format!("{url}/v1/cluster")).expect("GET /v1/cluster");
    assert_eq!(status, 200, "{cluster}");
    cluster["groups"].as_array().cloned().unwrap_or_default()
}

fn group(url: &str, name: &str) -> Option<Value> {
    groups(url).into_iter().find(|g| g["name"] == name)
}

fn served_models(url: &str) -> Vec<String> {
    let (_, list) = get(&format!("{url}/v1/models")).expect("GET /v1/models");
    (list["data"].as_array().into_iter().flatten())
        .filter_map(|m| m["id"].as_str().map(String::from))
        .collect()
}

fn complete(url: &str, model: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": [1, 5, 9], "max_tokens": 2, "temperature": 0});
    post(&format!("{url}/v1/completions"), &body).expect("POST /v1/completions")
}

#[test]
fn groups_and_models_come_and_go_while_the_others_run_on() {
    let mut cluster =
        Cluster::start_local(&[GroupSpec::local("a", "m", &fixture("llama-gqa/f32"), 1)])
            .expect("cluster starts");
    let url = cluster.http.clone();
    wait_ready(&url, Duration::from_secs(60), || cluster.logs());
    let first = cluster.topology.clone();
    let first_text = std::fs::read_to_string(&first).unwrap();
    let a_pid = cluster.proc("a-0").child.id();
    let a_epoch = group(&url, "a").expect("group a")["epoch"].clone();

    // Refused, each saying what to change, and nothing changes.
    let (status, answer) = apply_text(&url, &first, "[[group]]\nname = ");
    assert_eq!(status, 400, "{answer}");
    let (status, answer) = apply_text(&url, Path::new("topology.toml"), &first_text);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("absolute path"), "{answer}");
    let a_port = first_text
        .lines()
        .find(|l| l.starts_with("port = "))
        .unwrap();
    let moved = first_text.replace(a_port, &format!("port = {}", free_port()));
    let (status, answer) = apply_text(&url, &first, &moved);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("another name"), "{answer}");
    let m_path = fixture("llama-gqa/f32").display().to_string();
    let new_files = first_text.replace(&m_path, &fixture("llama-gqa/bf16").display().to_string());
    let (status, answer) = apply_text(&url, &first, &new_files);
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer.to_string().contains("tessera model deploy"),
        "{answer}"
    );
    let body = json!({"path": first, "text": first_text});
    let (status, answer) = post_as(TEST_API_KEY, &format!("{url}/v1/cluster/topology"), &body);
    assert_eq!(status, 403, "an inference key: {answer}");
    let (status, answer) = get(&format!("{url}/v1/cluster/topology")).unwrap();
    assert_eq!(status, 403, "{answer}");
    assert_eq!(groups(&url).len(), 1);

    // Add group b (model m, slow steps) and group c of the new model n.
    let mut second_text = first_text.clone();
    let _ = write!(
        second_text,
        "[[model]]\nname = \"n\"\npath = \"{}\"\n\n{}{}",
        fixture("llama-gqa/bf16").display(),
        group_text("b", "m", 2),
        group_text("c", "n", 1)
    );
    let second = cluster.dir.path().join("topology-2.toml");
    std::fs::write(&second, &second_text).unwrap();
    let (ok, said) = tessera_apply(&url, &second, &["--no-wait"]);
    assert!(ok, "{said}");
    assert!(
        said.contains("topology generation 1: added groups b, c; added models n"),
        "{said}"
    );
    for (group, rank) in [("b", 0), ("b", 1), ("c", 0)] {
        let identity = Identity::Shard {
            group: group.into(),
            rank: Rank(rank),
        };
        issue_one(&cluster.certs, &identity).expect("a certificate for the new shard");
    }
    cluster.topology = second.clone();
    // An added group starts on its model's version: the leader's rollout loop (which
    // looks every second) leaves it in routing instead of switching it to that version.
    std::thread::sleep(Duration::from_millis(1500));
    for name in ["b", "c"] {
        let waiting = group(&url, name).unwrap();
        assert_eq!(waiting["switching"], json!(false), "{waiting}");
    }
    let slow = [("TESSERA_FAULT_STEP_DELAY_MS", "100")];
    for (group, rank) in [("b", 0), ("b", 1), ("c", 0)] {
        cluster
            .start_shard_with(group, rank, &slow[..usize::from(group == "b")])
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while ["b", "c"]
        .iter()
        .any(|g| group(&url, g).is_none_or(|g| g["state"] != "serving"))
    {
        assert!(
            Instant::now() < deadline,
            "b and c serve\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, applied) = get_admin(&url);
    assert_eq!(
        (status, applied["generation"].as_u64()),
        (200, Some(1)),
        "{applied}"
    );
    assert_eq!(served_models(&url), ["m", "n"]);
    let (status, answer) = complete(&url, "n");
    assert_eq!(status, 200, "model n serves: {answer}");
    assert_eq!(cluster.proc("a-0").child.id(), a_pid);
    assert_eq!(
        group(&url, "a").unwrap()["epoch"],
        a_epoch,
        "a was not restarted"
    );
    let (ok, said) = tessera_apply(&url, &second, &[]);
    assert!(ok && said.contains("nothing to change"), "{said}");

    // Back to the first file while a stream runs on b: b drains before it goes.
    let drain = format!("{url}/v1/cluster/groups/a/drain");
    assert_eq!(post_as(TEST_ADMIN_KEY, &drain, &json!({})).0, 200);
    let target = format!("{url}/v1/completions");
    let body = json!({
        "model": "m", "prompt": [3, 8, 2], "max_tokens": 24, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let stream = std::thread::spawn(move || sse(&target, Some(&body), None));
    let deadline = Instant::now() + Duration::from_secs(20);
    while group(&url, "b").unwrap()["running"] == 0 {
        assert!(Instant::now() < deadline, "the stream runs on b");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, said) = tessera_apply(&url, &first, &[]);
    assert!(ok, "{said}");
    assert!(
        said.contains("removed groups b, c; removed models n")
            && said.contains("every removed group is gone"),
        "{said}"
    );
    let (events, done) = stream.join().unwrap();
    let reasons: Vec<String> = (events.iter())
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from))
        .collect();
    assert!(
        done && reasons == ["length"],
        "the stream ran to its end: {reasons:?}"
    );
    for name in ["b-0", "b-1", "c-0"] {
        let exited = wait_exit(&mut cluster, name, Duration::from_secs(15));
        assert_eq!(
            exited,
            Some(true),
            "{name} exits cleanly\n{}",
            cluster.logs()
        );
    }
    assert!(groups(&url).iter().all(|g| g["name"] == "a"));
    assert_eq!(served_models(&url), ["m"]);
    assert_eq!(complete(&url, "n").0, 404, "model n is gone");
    let resume = format!("{url}/v1/cluster/groups/a/resume");
    assert_eq!(post_as(TEST_ADMIN_KEY, &resume, &json!({})).0, 200);
    assert_eq!(complete(&url, "m").0, 200);
    assert_eq!(cluster.proc("a-0").child.id(), a_pid);
    assert_eq!(
        group(&url, "a").unwrap()["epoch"],
        a_epoch,
        "a was not restarted"
    );
}

#[test]
fn the_applied_topology_outlives_its_leader_and_wins_over_a_restarted_peers_file() {
    let groups = [GroupSpec::local("a", "m", &fixture("llama-gqa/f32"), 1)];
    let (mut cluster, urls) = Cluster::start_local_peers(3, &groups, &[]).expect("cluster starts");
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    wait_ready(all[0], Duration::from_secs(60), || cluster.logs());
    let leader = wait_for_leader(&all, None, Duration::from_secs(15));
    let follower = all[leader as usize % 3];
    let second = cluster.dir.path().join("topology-2.toml");
    let mut text = std::fs::read_to_string(&cluster.topology).unwrap();
    let _ = write!(
        text,
        "[[model]]\nname = \"n\"\npath = \"{}\"\n\n{}",
        fixture("llama-gqa/bf16").display(),
        group_text("b", "n", 1)
    );
    std::fs::write(&second, &text).unwrap();
    let (ok, said) = tessera_apply(follower, &second, &["--no-wait"]);
    assert!(
        ok && said.contains("added groups b"),
        "through a follower: {said}"
    );
    let identity = Identity::Shard {
        group: "b".into(),
        rank: Rank(0),
    };
    issue_one(&cluster.certs, &identity).unwrap();
    let first = std::mem::replace(&mut cluster.topology, second);
    cluster.start_shard("b", 0).unwrap();
    let serving = |url: &str| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while group(url, "b").is_none_or(|g| g["state"] != "serving") {
            assert!(Instant::now() < deadline, "b serves");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    serving(follower);
    // Every peer serves model n: a follower's model list is its own.
    for url in &all {
        assert_eq!(served_models(url), ["m", "n"], "{url}");
    }

    let others = kill_leader(&mut cluster, &all, leader);
    serving(others[0]);
    assert_eq!(
        complete(others[0], "n").0,
        200,
        "b serves n under the new leader"
    );

    // The killed peer comes back with the first file (which has no model n) and follows
    // the applied topology all the same.
    cluster.topology = first;
    cluster.start_coordinator_peer(leader as usize).unwrap();
    let back = all[leader as usize - 1];
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&format!("{back}/v1/models"))
        .map_or(true, |(_, list)| !list.to_string().contains("\"n\""))
    {
        assert!(
            Instant::now() < deadline,
            "the restarted peer serves model n\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(served_models(back), ["m", "n"]);
}

fn get_admin(url: &str) -> (u16, Value) {
    get_as(TEST_ADMIN_KEY, &format!("{url}/v1/cluster/topology")).expect("GET")
}

/// Whether process `name` exited successfully within `within` (`None`: still running).
fn wait_exit(cluster: &mut Cluster, name: &str, within: Duration) -> Option<bool> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = cluster.proc(name).child.try_wait().expect("try_wait") {
            return Some(status.success());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
