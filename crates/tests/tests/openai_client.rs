//! The official `openai` Python client against a cluster started by `tessera up` (as
//! `faults.rs` starts one) on the demo model: `scripts/openai_client_check.py` runs chat and
//! completions, streaming and not, with an API key, and must pass.
//!
//! Needs `python3` with the `openai` package (`.ci/run` installs it). Without it the test
//! fails when `CI` is set and prints SKIPPED otherwise; without the demo model it follows
//! [`tessera_tests::demo_model`].

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tessera_tests::{GroupSpec, bin, demo_model, free_port, repo, topology_text};

const MODEL: &str = "demo";
const API_KEY: &str = "openai-client-check-key";

/// `tessera up` in its own process group, killed with everything it started on drop.
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
            .env("TESSERA_API_KEYS", API_KEY)
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

    /// Waits until `/ready` answers 200: every model has a group that can step.
    fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = ureq::get(format!("{}/ready", self.http)).call()
                && r.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not ready after {timeout:?}\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(200));
        }
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

/// Whether `python3` can import `openai`; panics under CI when it cannot.
fn openai_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but `python3 -c \"import openai\"` fails: pip install openai"
        );
        eprintln!("SKIPPED: python3 cannot import openai (pip install openai)");
    }
    ok
}

#[test]
fn official_openai_client_passes() {
    if !openai_available() {
        return;
    }
    let Some(model) = demo_model() else {
        return;
    };
    let up = Up::start(&[GroupSpec::local("g0", MODEL, &model, 1)]);
    up.wait_ready(Duration::from_secs(120));
    let output = Command::new("python3")
        .arg(repo().join("scripts/openai_client_check.py"))
        .arg(format!("{}/v1", up.http))
        .arg(MODEL)
        .env("OPENAI_API_KEY", API_KEY)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the openai client check failed ({}):\n{stdout}\n{stderr}\n--- cluster log\n{}",
        output.status,
        up.log()
    );
    assert!(stdout.contains("openai client check passed"), "{stdout}");
}
