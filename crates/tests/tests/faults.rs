//! Fault injection against a cluster started by `tessera up`: a shard killed with
//! SIGKILL in the middle of a generation, and a shard frozen with SIGSTOP. The request
//! must fail within 5 s with an error naming the group and the rank, no process may
//! hang, and the group must serve again once the shard is back (restarted by
//! `tessera up`, or continued).
//!
//! `TESSERA_FAULT_STEP_DELAY_MS` makes every step of the shards slow enough that the
//! fault lands during the generation.

use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tessera_tests::up::Up;
use tessera_tests::{GroupSpec, fixture, post, shard_pid};

/// Steps slow enough that a fault lands during a generation.
const FAULT_ENV: &[(&str, &str)] = &[("TESSERA_FAULT_STEP_DELAY_MS", "40")];

/// What these tests ask of the cluster besides what [`Up`] does.
trait Faults {
    fn complete(&self, model: &str, max_tokens: usize) -> (u16, serde_json::Value);
    fn wait_serving(&self, model: &str, timeout: Duration);
    fn pid(&self, group: &str, rank: usize) -> i32;
}

impl Faults for Up {
    fn complete(&self, model: &str, max_tokens: usize) -> (u16, serde_json::Value) {
        let body = json!({
            "model": model, "prompt": [1, 5, 9], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": true, "return_token_ids": true,
        });
        post(&format!("{}/v1/completions", self.http), &body)
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.log()))
    }

    /// Waits until a request succeeds (the group is serving).
    fn wait_serving(&self, model: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = post(
                &format!("{}/v1/completions", self.http),
                &json!({"model": model, "prompt": [1], "max_tokens": 1}),
            ) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "group of {model} not serving after {timeout:?}\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(200));
        }
    }

    fn pid(&self, group: &str, rank: usize) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(pid) = shard_pid(&self.topology, group, rank) {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "no shard {group}/{rank}\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Starts a long generation, applies `fault` after a second, and returns the answer and
/// how long after the fault it came.
fn generation_under_fault(
    up: &Up,
    model: &str,
    fault: impl FnOnce(),
) -> (u16, serde_json::Value, Duration) {
    let (status, answer, at) = thread::scope(|s| {
        let request = s.spawn(|| {
            let answer = up.complete(model, 120);
            (answer, Instant::now())
        });
        thread::sleep(Duration::from_secs(1));
        let faulted = Instant::now();
        fault();
        let ((status, answer), done) = request.join().expect("request thread");
        (status, answer, done.saturating_duration_since(faulted))
    });
    (status, answer, at)
}

#[test]
fn killed_shard_fails_the_request_and_comes_back() {
    let path = fixture("llama-gqa/f32");
    let up = Up::start(&[GroupSpec::local("killme", "m", &path, 2)], FAULT_ENV);
    up.wait_serving("m", Duration::from_secs(60));
    let victim = up.pid("killme", 1);
    let (status, answer, after) = generation_under_fault(&up, "m", || {
        kill(Pid::from_raw(victim), Signal::SIGKILL).expect("kill -9 the shard");
    });
    assert_ne!(
        status, 200,
        "the generation cannot survive a dead rank: {answer}"
    );
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("group killme: rank 1 "),
        "the error must name the group and the rank: {answer}"
    );
    assert!(
        after < Duration::from_secs(5),
        "failed {after:?} after the kill\n{}",
        up.log()
    );
    // `tessera up` restarts the shard; the group serves again.
    up.wait_serving("m", Duration::from_secs(60));
    assert_ne!(up.pid("killme", 1), victim, "rank 1 is a new process");
    let (status, answer) = up.complete("m", 4);
    assert_eq!(status, 200, "{answer}");
    up.stop();
}

#[test]
fn stopped_shard_is_detected_and_recovers_when_continued() {
    let path = fixture("llama-gqa/f32");
    let up = Up::start(
        &[
            GroupSpec::local("frozen", "m2", &path, 2),
            GroupSpec::local("solo", "m1", &path, 1),
        ],
        FAULT_ENV,
    );
    up.wait_serving("m2", Duration::from_secs(60));
    up.wait_serving("m1", Duration::from_secs(60));

    // tp = 2: the other rank's collective deadline names the frozen rank.
    let victim = up.pid("frozen", 0);
    let (status, answer, after) = generation_under_fault(&up, "m2", || {
        kill(Pid::from_raw(victim), Signal::SIGSTOP).expect("SIGSTOP the shard");
    });
    assert_ne!(status, 200, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("group frozen: rank 0 "),
        "the error must name the group and the rank: {answer}"
    );
    assert!(
        after < Duration::from_secs(5),
        "failed {after:?} after SIGSTOP\n{}",
        up.log()
    );
    kill(Pid::from_raw(victim), Signal::SIGCONT).expect("SIGCONT");
    up.wait_serving("m2", Duration::from_secs(60));

    // tp = 1: no collective to notice; the coordinator's step deadline does.
    let alone = up.pid("solo", 0);
    let (status, answer, after) = generation_under_fault(&up, "m1", || {
        kill(Pid::from_raw(alone), Signal::SIGSTOP).expect("SIGSTOP the shard");
    });
    assert_ne!(status, 200, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("group solo: rank 0 "),
        "the error must name the group and the rank: {answer}"
    );
    assert!(
        after < Duration::from_secs(10),
        "failed {after:?} after SIGSTOP\n{}",
        up.log()
    );
    kill(Pid::from_raw(alone), Signal::SIGCONT).expect("SIGCONT");
    up.wait_serving("m1", Duration::from_secs(60));
    up.stop();
}
