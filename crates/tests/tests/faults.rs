//! Fault injection against a cluster started by `tessera up`: a shard killed with
//! SIGKILL in the middle of a generation, and a shard frozen with SIGSTOP. The request
//! must fail within 5 s with an error naming the group and the rank, no process may
//! hang, and the group must serve again once the shard is back (restarted by
//! `tessera up`, or continued).
//!
//! `TESSERA_FAULT_STEP_DELAY_MS` makes every step of the shards slow enough that the
//! fault lands during the generation.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::json;
use tessera_tests::{GroupSpec, bin, fixture, free_port, post, shard_pid, topology_text};

struct Up {
    child: Child,
    dir: tempfile::TempDir,
    topology: std::path::PathBuf,
    http: String,
}

impl Up {
    fn start(groups: &[GroupSpec]) -> Up {
        let dir = tempfile::tempdir().expect("temp dir");
        let quic = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let text = topology_text("local", &quic, &http, &[("local", "127.0.0.1")], groups);
        let topology = dir.path().join("topology.toml");
        std::fs::write(&topology, text).expect("write topology");
        let log = std::fs::File::create(dir.path().join("up.log")).expect("log file");
        let child = Command::new(bin("tessera"))
            .arg("up")
            .arg("--topology")
            .arg(&topology)
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .env("TESSERA_FAULT_STEP_DELAY_MS", "40")
            .env("TESSERA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("tessera up starts");
        Up {
            child,
            dir,
            topology,
            http: format!("http://{http}"),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("up.log")).unwrap_or_default()
    }

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

    /// SIGTERM, then every process must be gone within the grace period.
    fn stop(mut self) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "tessera up did not stop\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(100));
        }
        let topology = self.topology.display().to_string();
        let left = tessera_tests::find_pids(&[&topology]);
        assert!(
            left.is_empty(),
            "processes left behind: {left:?}\n{}",
            self.log()
        );
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        let _ = self.child.wait();
        let topology = self.topology.display().to_string();
        for pid in tessera_tests::find_pids(&[&topology]) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
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
    let up = Up::start(&[GroupSpec::local("killme", "m", &path, 2)]);
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
    let up = Up::start(&[
        GroupSpec::local("frozen", "m2", &path, 2),
        GroupSpec::local("solo", "m1", &path, 1),
    ]);
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
