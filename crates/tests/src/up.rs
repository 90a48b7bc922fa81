//! A cluster started the way users start one: `tessera up` on a topology written into a
//! temporary directory, in its own process group, killed with everything it started when
//! dropped.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::{GroupSpec, bin, find_pids, free_port, topology_text};

#[derive(Debug)]
pub struct Up {
    child: Child,
    dir: tempfile::TempDir,
    pub topology: PathBuf,
    /// `http://host:port` of the API.
    pub http: String,
}

impl Up {
    /// Starts `tessera up` on a one-coordinator topology of `groups`, with `env` added to
    /// its environment (which its coordinator and shards inherit).
    pub fn start(groups: &[GroupSpec], env: &[(&str, &str)]) -> Up {
        let dir = tempfile::tempdir().expect("temp dir");
        let quic = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let text = topology_text("local", &quic, &http, &[("local", "127.0.0.1")], groups);
        let topology = dir.path().join("topology.toml");
        std::fs::write(&topology, text).expect("write topology");
        Up::spawn(dir, topology, &[], env, format!("http://{http}"))
    }

    /// Starts `tessera up` for the processes of `host` alone in a topology written
    /// elsewhere, with its certificates `certs` (a [`crate::Cluster`] prepared them and runs
    /// the rest); `http` is the API to wait for (`http://host:port`).
    pub fn start_host(
        topology: &Path,
        certs: &Path,
        host: &str,
        http: &str,
        env: &[(&str, &str)],
    ) -> Up {
        let dir = tempfile::tempdir().expect("temp dir");
        let certs = certs.display().to_string();
        let args = ["--host", host, "--certs", &certs];
        Up::spawn(dir, topology.to_path_buf(), &args, env, http.to_string())
    }

    fn spawn(
        dir: tempfile::TempDir,
        topology: PathBuf,
        args: &[&str],
        env: &[(&str, &str)],
        http: String,
    ) -> Up {
        let log = std::fs::File::create(dir.path().join("up.log")).expect("log file");
        let mut command = Command::new(bin("tessera"));
        command
            .arg("up")
            .arg("--topology")
            .arg(&topology)
            .args(args)
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .env("TESSERA_LOG", "info");
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
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
            http,
        }
    }

    /// Everything `tessera up` and its children logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("up.log")).unwrap_or_default()
    }

    /// Waits until `/ready` answers 200 (see [`crate::wait_ready`]).
    pub fn wait_ready(&self, timeout: Duration) {
        crate::wait_ready(&self.http, timeout, || self.log());
    }

    /// The pid of the coordinator `tessera up` started.
    pub fn coordinator_pid(&self) -> Option<i32> {
        let topology = self.topology.display().to_string();
        find_pids(&["tessera-coordinator", &topology])
            .first()
            .copied()
    }

    /// SIGTERM, then every process must be gone within 20 s.
    pub fn stop(mut self) {
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
        let left = find_pids(&[&topology]);
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
        for pid in find_pids(&[&topology]) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}
