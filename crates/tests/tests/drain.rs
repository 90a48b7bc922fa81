//! Graceful drain of coordinator peers (issue 19, item 2), on real processes:
//! - SIGTERM during 16 streams: every stream ends by length, new requests get 503
//!   `draining` meanwhile, and the peer exits 0;
//! - `tessera drain` on the leader of three peers: it hands leadership over and exits, and
//!   the others serve on;
//! - a rolling restart of three peers under load of streams: no stream is cut, for a
//!   client that retries what was refused before it began (503, or a connection refused).

use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tessera_tests::failover::{slow_three_peers, wait_for_leader};
use tessera_tests::{
    Cluster, GroupSpec, TEST_ADMIN_KEY, TEST_API_KEY, bin, fixture, get, metric, post, read_sse,
    sse, wait_ready,
};

const STREAMS: usize = 16;
const TOKENS: usize = 24;

/// Waits for process `name` to exit, for `timeout` at most.
fn wait_exit(cluster: &mut Cluster, name: &str, timeout: Duration) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = cluster.proc(name).child.try_wait().expect("wait") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{name} still runs {timeout:?} after the drain began\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn completion(max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "m", "prompt": [3, 8, 2, 6], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": stream,
    })
}

/// The finish reason a stream's events give (the last one that gives one).
fn finish_reason(events: &[tessera_tests::SseEvent]) -> Option<String> {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from))
        .next_back()
}

#[test]
fn sigterm_during_16_streams_lets_every_one_finish_by_length() {
    let group = GroupSpec::local("g", "m", &fixture("llama-gqa/f32"), 2);
    let mut cluster = Cluster::start_local_with(&[group], &[("TESSERA_FAULT_STEP_DELAY_MS", "60")])
        .expect("cluster starts");
    let url = cluster.http.clone();
    wait_ready(&url, Duration::from_secs(30), String::new);
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let url = format!("{url}/v1/completions");
            std::thread::spawn(move || sse(&url, Some(&completion(TOKENS, true)), None))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&url, "tessera_api_in_flight_requests", "").unwrap_or(0.0) < STREAMS as f64 {
        assert!(
            Instant::now() < deadline,
            "the 16 streams never ran at once"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.signal("coordinator-1", Signal::SIGTERM);

    // New requests are refused while the streams run on.
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        let (status, answer) = post(&format!("{url}/v1/completions"), &completion(2, false))
            .expect("the draining peer still answers");
        if status == 503 {
            break answer;
        }
        assert_eq!(status, 200, "{answer}");
        assert!(Instant::now() < deadline, "no refusal 5 s after SIGTERM");
    };
    assert_eq!(refused["error"]["code"], "draining", "{refused}");
    let (ready, body) = get(&format!("{url}/ready")).expect("GET /ready");
    assert_eq!(
        (ready, &body["status"]),
        (503, &json!("draining")),
        "{body}"
    );

    for (i, stream) in streams.into_iter().enumerate() {
        let (events, done) = stream.join().expect("stream thread");
        assert!(done, "stream {i} was cut: {events:?}\n{}", cluster.logs());
        assert_eq!(
            finish_reason(&events).as_deref(),
            Some("length"),
            "stream {i}"
        );
    }
    let status = wait_exit(&mut cluster, "coordinator-1", Duration::from_secs(30));
    assert!(status.success(), "{status}\n{}", cluster.logs());
    let log = std::fs::read_to_string(&cluster.proc("coordinator-1").log).expect("log");
    assert!(log.contains("drained: no request in flight"), "{log}");
}

#[test]
fn tessera_drain_on_the_leader_hands_leadership_over_and_the_peer_exits() {
    let (mut cluster, urls) = slow_three_peers();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    let leader = wait_for_leader(&all, None, Duration::from_secs(20));
    let leader_url = all[leader as usize - 1];
    wait_ready(leader_url, Duration::from_secs(30), String::new);
    let started = Instant::now();
    let out = Command::new(bin("tessera"))
        .args(["drain", "--url", leader_url, "--admin-key", TEST_ADMIN_KEY])
        .output()
        .expect("tessera drain runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{}", cluster.logs());
    assert!(stderr.contains("the peer has stopped"), "{stderr}");
    let name = format!("coordinator-{leader}");
    let status = wait_exit(&mut cluster, &name, Duration::from_secs(10));
    assert!(status.success(), "{status}");

    let others: Vec<&str> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as u64 + 1 != leader)
        .map(|(_, u)| *u)
        .collect();
    let next = wait_for_leader(&others, Some(leader), Duration::from_secs(10));
    eprintln!(
        "peer {leader} drained and handed over to {next} in {:?}",
        started.elapsed()
    );
    let log = std::fs::read_to_string(&cluster.proc(&name).log).expect("log");
    assert!(log.contains("leadership handed over"), "{log}");
    wait_ready(others[0], Duration::from_secs(30), String::new);
    let (status, answer) = post(
        &format!("{}/v1/completions", others[0]),
        &completion(4, false),
    )
    .expect("POST");
    assert_eq!(status, 200, "{answer}");

    // An inference key may not drain a peer.
    let out = Command::new(bin("tessera"))
        .args(["drain", "--url", others[0], "--admin-key", TEST_API_KEY])
        .output()
        .expect("tessera drain runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("answered 403"), "{stderr}");
}

/// How one client request ended, after its retries.
#[derive(Debug, Default)]
struct Tally {
    completed: usize,
    retried: usize,
    failed: Vec<String>,
}

/// One streamed request, retried on another peer while it is refused before it starts:
/// 503 (a draining peer, no leader yet), a refused connection (a peer that stopped), or a
/// connection reset or closed before any answer, also while the request was being written
/// (a peer closing its listener as it stops: connections the kernel queued but the server
/// never took are reset, and a draining peer runs no request it has not answered). Anything else is a failure: a stream cut after
/// it began (its client has tokens already and cannot simply retry), an interrupted
/// request, a wrong answer.
fn request_until_served(urls: &[String], first: usize, tally: &Mutex<Tally>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let deadline = Instant::now() + Duration::from_secs(60);
    let fail = |failure: String| tally.lock().expect("tally").failed.push(failure);
    let mut peer = first;
    loop {
        let url = format!("{}/v1/completions", urls[peer % urls.len()]);
        let sent = agent
            .post(&url)
            .header("Authorization", &format!("Bearer {TEST_API_KEY}"))
            .send_json(completion(8, true));
        // Only a refusal before the stream began goes on to the retry below.
        match sent {
            Ok(mut response) if response.status() == 200 => {
                let reader = std::io::BufReader::new(response.body_mut().as_reader());
                let (events, done) = read_sse(reader, |_| true);
                if done && finish_reason(&events).as_deref() == Some("length") {
                    tally.lock().expect("tally").completed += 1;
                } else {
                    fail(format!("{url}: a stream cut or wrong: {events:?}"));
                }
                return;
            }
            Ok(mut response) => {
                let status = response.status().as_u16();
                let body: Value = response.body_mut().read_json().unwrap_or(Value::Null);
                if status != 503 || body["error"]["code"] == "request_interrupted" {
                    return fail(format!("{url}: {status} {body}"));
                }
            }
            Err(ureq::Error::Io(e)) if unanswered(e.kind()) => {}
            Err(ureq::Error::ConnectionFailed) => {}
            Err(error) => return fail(format!("{url}: {error}")),
        }
        tally.lock().expect("tally").retried += 1;
        if Instant::now() > deadline {
            return fail(format!("{url}: refused for 60 s"));
        }
        peer += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_rolling_restart_of_three_peers_under_load_fails_no_request() {
    const CLIENTS: usize = 4;
    let (mut cluster, urls) = slow_three_peers();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    let leader = wait_for_leader(&all, None, Duration::from_secs(20));
    wait_ready(
        all[leader as usize - 1],
        Duration::from_secs(30),
        String::new,
    );
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (urls, tally, stop) = (urls.clone(), Arc::clone(&tally), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut i = c;
                while !stop.load(Ordering::Relaxed) {
                    request_until_served(&urls, i, &tally);
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    // Followers first, the leader last, as an operator would.
    let mut order: Vec<u64> = (1..=3).filter(|&p| p != leader).collect();
    order.push(leader);
    for peer in order {
        let name = format!("coordinator-{peer}");
        cluster.signal(&name, Signal::SIGTERM);
        let status = wait_exit(&mut cluster, &name, Duration::from_secs(40));
        assert!(status.success(), "{name}: {status}\n{}", cluster.logs());
        cluster
            .start_coordinator_peer(peer as usize)
            .expect("restart");
        wait_ready(all[peer as usize - 1], Duration::from_secs(30), String::new);
        wait_for_leader(&all, None, Duration::from_secs(20));
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().expect("client thread");
    }
    let tally = tally.lock().expect("tally");
    eprintln!(
        "rolling restart: {} requests completed, {} refusals retried, {} failed",
        tally.completed,
        tally.retried,
        tally.failed.len()
    );
    assert!(
        tally.failed.is_empty(),
        "{:#?}\n{}",
        tally.failed,
        cluster.logs()
    );
    assert!(tally.completed >= 20, "too little load: {tally:?}");
}

/// Connection errors before any answer: the peer refused the connection, or reset or closed
/// it before writing a response (ureq says "Peer disconnected" for the latter).
fn unanswered(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        kind,
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::UnexpectedEof
            // The peer had closed the connection (one it queued but never took as it
            // stopped, or one kept alive from before its restart) while the request was
            // being written: it never read the request.
            | K::BrokenPipe
    )
}
