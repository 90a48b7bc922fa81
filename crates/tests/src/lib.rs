//! Helpers for the end-to-end tests: a cluster of real `tessera-coordinator` and
//! `tessera-shard` processes described by a topology written into a temporary directory,
//! and a small HTTP client for its API.
//!
//! The binaries are the workspace's own, found next to the test executable's `deps/`
//! directory (`cargo test --workspace` builds them). Every process runs in its own
//! process group, logs to a file in the cluster's directory, and is killed when the
//! [`Cluster`] is dropped; a failing test prints the logs.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::fs::File;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

pub mod chaos;
pub mod failover;
mod http;
pub mod netns;
mod probe;
pub mod up;

pub use http::{
    SseEvent, TEST_ADMIN_KEY, TEST_API_KEY, get, get_as, metric, post, post_as, post_with,
    read_sse, sse, token_ids, wait_ready,
};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
pub use probe::{find_pids, first_and_steady_latency, leader_seen_by, open_fds, rss, shard_pid};
use serde_json::{Value, json};

/// The repository root: `TESSERA_REPO_ROOT` where a test binary runs away from its build
/// tree (`scripts/gpu-check.sh` on a GPU machine), else where it was built.
pub fn repo() -> PathBuf {
    std::env::var_os("TESSERA_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// A fixture model directory or file under `fixtures/models`.
pub fn fixture(rel: &str) -> PathBuf {
    repo().join("fixtures/models").join(rel)
}

/// The demo model, required when `TESSERA_REQUIRE_DEMO_MODEL=1` (CI); `None` otherwise
/// when it has not been fetched.
pub fn demo_model() -> Option<PathBuf> {
    let path = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    if std::env::var("TESSERA_REQUIRE_DEMO_MODEL").as_deref() == Ok("1") {
        panic!(
            "{} is missing: run scripts/get-demo-model.sh",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: {} is missing (scripts/get-demo-model.sh)",
        path.display()
    );
    None
}

/// The prompts of fixture `model`'s `expected.json` with transformers' greedy tokens for
/// its f32 weights: (prompt, greedy) pairs.
pub fn f32_greedy(model: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    #[derive(serde::Deserialize)]
    struct Expected {
        prompts: Vec<Vec<u32>>,
        variants: std::collections::BTreeMap<String, Variant>,
    }
    #[derive(serde::Deserialize)]
    struct Variant {
        results: Vec<Greedy>,
    }
    #[derive(serde::Deserialize)]
    struct Greedy {
        greedy: Vec<u32>,
    }
    let path = fixture(&format!("{model}/expected.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let expected: Expected =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let results = &expected.variants["f32"].results;
    expected
        .prompts
        .into_iter()
        .zip(results.iter().map(|r| r.greedy.clone()))
        .collect()
}

/// A workspace binary, built by `cargo test --workspace` (or in `TESSERA_BIN_DIR`, where
/// the binaries were prepared elsewhere: `scripts/gpu-prepare.sh`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    let dir = match std::env::var_os("TESSERA_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("tests run from target/<profile>/deps")
            .to_path_buf(),
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        path.display()
    );
    path
}

/// A TCP and UDP port that was free a moment ago on 127.0.0.1, and that this process has
/// not handed out before (the system may offer a port again once its socket is closed).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = tcp.local_addr().expect("bound").port();
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !given.contains(&port) && UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
}

/// One group of a test topology.
#[derive(Clone, Debug)]
pub struct GroupSpec {
    pub name: String,
    /// The topology's model name (one `[[model]]` per distinct name).
    pub model: String,
    pub path: PathBuf,
    pub tp: usize,
    /// `"shm"` or `"tcp"`.
    pub collective: &'static str,
    /// Host name per rank (all `local` unless set).
    pub hosts: Vec<String>,
    /// Each rank's KV budget, as the topology writes it.
    pub kv_memory: String,
    /// `"exact"` or `"fast"`.
    pub precision: &'static str,
}

impl GroupSpec {
    pub fn local(name: &str, model: &str, path: &Path, tp: usize) -> GroupSpec {
        GroupSpec {
            name: name.into(),
            model: model.into(),
            path: path.into(),
            tp,
            collective: "shm",
            hosts: vec!["local".into(); tp],
            kv_memory: "16MiB".into(),
            precision: "exact",
        }
    }
}

/// The text of a topology: one coordinator, the given hosts (`name`, `address`) and groups.
pub fn topology_text(
    coordinator_host: &str,
    quic: &str,
    http: &str,
    hosts: &[(&str, &str)],
    groups: &[GroupSpec],
) -> String {
    peers_topology_text(
        &[(coordinator_host, quic.to_string(), http.to_string())],
        hosts,
        groups,
    )
}

/// The text of a topology with coordinator peers 1, 2, … (`host`, `quic`, `http` each).
/// `n` coordinator peers on host `local` of loopback: (host, QUIC address, HTTP address)
/// each, for [`peers_topology_text`].
pub fn local_peer_addrs(n: usize) -> Vec<(&'static str, String, String)> {
    (0..n)
        .map(|_| {
            (
                "local",
                format!("127.0.0.1:{}", free_port()),
                format!("127.0.0.1:{}", free_port()),
            )
        })
        .collect()
}

pub fn peers_topology_text(
    peers: &[(&str, String, String)],
    hosts: &[(&str, &str)],
    groups: &[GroupSpec],
) -> String {
    let mut t = String::new();
    for (i, (host, quic, http)) in peers.iter().enumerate() {
        let id = i + 1;
        let _ = write!(
            t,
            "[[coordinator]]\nid = {id}\nhost = \"{host}\"\nquic = \"{quic}\"\nhttp = \"{http}\"\ndata_dir = \"coordinator-{id}\"\n\n"
        );
    }
    for (name, address) in hosts {
        let _ = write!(
            t,
            "[[host]]\nname = \"{name}\"\naddress = \"{address}\"\n\n"
        );
    }
    let mut models: Vec<(&str, &Path)> = Vec::new();
    for g in groups {
        if !models.iter().any(|(m, _)| *m == g.model) {
            models.push((&g.model, &g.path));
        }
    }
    for (name, path) in models {
        let _ = write!(
            t,
            "[[model]]\nname = \"{name}\"\npath = \"{}\"\n\n",
            path.display()
        );
    }
    for g in groups {
        let _ = write!(
            t,
            "[[group]]\nname = \"{}\"\nmodel = \"{}\"\ntp = {}\ncollective = \"{}\"\nprecision = \"{}\"\n\n",
            g.name, g.model, g.tp, g.collective, g.precision
        );
        for (rank, host) in g.hosts.iter().enumerate() {
            let _ = write!(
                t,
                "[[group.shard]]\nrank = {rank}\nhost = \"{host}\"\ndevice = \"cpu\"\nthreads = 1\nport = {}\nkv_memory = \"{}\"\n\n",
                free_port(),
                g.kv_memory
            );
        }
    }
    t
}

/// A running process of the cluster.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

/// The command prefix for a process, by its name (e.g. `ip netns exec NS`).
pub type Wrap = Box<dyn Fn(&str) -> Vec<String> + Send + Sync>;

/// Real coordinator and shard processes for one topology.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub topology: PathBuf,
    pub certs: PathBuf,
    pub http: String,
    pub procs: Vec<Proc>,
    /// Prefix for every command (e.g. `ip netns exec NS`), per process name.
    pub wrap: Wrap,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("topology", &self.topology)
            .field("http", &self.http)
            .field("procs", &self.procs)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Writes `topology` (text) and its certificates into a new directory.
    pub fn prepare(topology: &str, http: &str) -> anyhow::Result<Cluster> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("topology.toml");
        std::fs::write(&path, topology)?;
        let parsed = tessera_topology::Topology::parse(topology, &path).map_err(|issues| {
            anyhow!(
                "bad test topology: {}",
                issues
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        })?;
        let certs = dir.path().join("certs");
        tessera_comm::certs::init_cluster(&parsed, &certs)?;
        Ok(Cluster {
            dir,
            topology: path,
            certs,
            http: format!("http://{http}"),
            procs: Vec::new(),
            wrap: Box::new(|_| Vec::new()),
        })
    }

    /// A one-host cluster of `groups`, with coordinator and every shard started.
    pub fn start_local(groups: &[GroupSpec]) -> anyhow::Result<Cluster> {
        Cluster::start_local_with(groups, &[])
    }

    /// [`Cluster::start_local`], with extra environment for every shard (fault knobs).
    pub fn start_local_with(
        groups: &[GroupSpec],
        shard_env: &[(&str, &str)],
    ) -> anyhow::Result<Cluster> {
        let quic = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let text = topology_text("local", &quic, &http, &[("local", "127.0.0.1")], groups);
        let mut cluster = Cluster::prepare(&text, &http)?;
        cluster.start_coordinator()?;
        for g in groups {
            for rank in 0..g.tp {
                cluster.start_shard_with(&g.name, rank, shard_env)?;
            }
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// A one-host cluster of `peers` coordinator peers (HTTP addresses in `peer_http`) and
    /// `groups`, every process started; [`Cluster::http`] is peer 1's.
    pub fn start_local_peers(
        peers: usize,
        groups: &[GroupSpec],
        shard_env: &[(&str, &str)],
    ) -> anyhow::Result<(Cluster, Vec<String>)> {
        Cluster::start_local_peers_with(peers, groups, shard_env, &[])
    }

    /// [`Cluster::start_local_peers`], with extra environment for every coordinator peer
    /// too (its flags' `TESSERA_*` variables).
    pub fn start_local_peers_with(
        peers: usize,
        groups: &[GroupSpec],
        shard_env: &[(&str, &str)],
        coordinator_env: &[(&str, &str)],
    ) -> anyhow::Result<(Cluster, Vec<String>)> {
        let addrs = local_peer_addrs(peers);
        let text = peers_topology_text(&addrs, &[("local", "127.0.0.1")], groups);
        let mut cluster = Cluster::prepare(&text, &addrs[0].2)?;
        for id in 1..=peers {
            cluster.start_coordinator_peer_with(
                id,
                &bin("tessera-coordinator"),
                coordinator_env,
            )?;
        }
        for g in groups {
            for rank in 0..g.tp {
                cluster.start_shard_with(&g.name, rank, shard_env)?;
            }
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        let urls = addrs
            .iter()
            .map(|(_, _, http)| format!("http://{http}"))
            .collect();
        Ok((cluster, urls))
    }

    /// Starts the coordinator with [`TEST_API_KEY`]: a coordinator whose HTTP address is
    /// not loopback (the multi-host test) refuses to start without a key.
    pub fn start_coordinator(&mut self) -> anyhow::Result<()> {
        self.start_coordinator_peer(1)
    }

    /// Starts coordinator peer `id` (process `coordinator-<id>`) with [`TEST_API_KEY`] and
    /// [`TEST_ADMIN_KEY`].
    pub fn start_coordinator_peer(&mut self, id: usize) -> anyhow::Result<()> {
        self.start_coordinator_peer_with(id, &bin("tessera-coordinator"), &[])
    }

    /// [`Cluster::start_coordinator_peer`] with this coordinator binary (one built with
    /// other features) and extra environment.
    pub fn start_coordinator_peer_with(
        &mut self,
        id: usize,
        program: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let args = vec![
            "--topology".to_string(),
            self.topology.display().to_string(),
            "--certs".into(),
            self.certs.display().to_string(),
            "--peer".into(),
            id.to_string(),
            "--api-key".into(),
            TEST_API_KEY.into(),
            "--admin-key".into(),
            TEST_ADMIN_KEY.into(),
        ];
        self.spawn(&format!("coordinator-{id}"), program, &args, env)
    }

    pub fn start_shard(&mut self, group: &str, rank: usize) -> anyhow::Result<()> {
        self.start_shard_with(group, rank, &[])
    }

    /// Starts a shard with extra environment (fault injection knobs).
    pub fn start_shard_with(
        &mut self,
        group: &str,
        rank: usize,
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let args = vec![
            "--topology".to_string(),
            self.topology.display().to_string(),
            "--group".into(),
            group.into(),
            "--rank".into(),
            rank.to_string(),
            "--certs".into(),
            self.certs.display().to_string(),
        ];
        self.spawn(
            &format!("{group}-{rank}"),
            &bin("tessera-shard"),
            &args,
            env,
        )
    }

    /// Starts `program` as process `name`, logging to `<dir>/<name>.log`.
    pub fn spawn(
        &mut self,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let log = self.dir.path().join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let prefix = (self.wrap)(name);
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(program);
                c
            }
            None => Command::new(program),
        };
        // Test clusters share this machine's cores: their shards are not pinned (unless a
        // test asks, through `env`).
        cmd.args(args)
            .env("TESSERA_LOG", "info")
            .env("TESSERA_PIN_THREADS", "0")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        self.procs.push(Proc {
            name: name.into(),
            child,
            log,
        });
        Ok(())
    }

    /// The process named `name` (the latest one started under that name).
    pub fn proc(&mut self, name: &str) -> &mut Proc {
        self.procs
            .iter_mut()
            .rev()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}"))
    }

    /// Sends `signal` to process `name`'s process group.
    pub fn signal(&mut self, name: &str, signal: Signal) {
        let pid = self.proc(name).child.id();
        let _ = killpg(Pid::from_raw(pid as i32), signal);
    }

    /// Waits for `GET /health`.
    pub fn wait_healthy(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = ureq::get(format!("{}/health", self.http)).call()
                && r.status() == 200
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the coordinator did not answer /health within {timeout:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until `/ready` answers 200 (see [`wait_ready`]).
    pub fn wait_ready(&self, timeout: Duration) {
        wait_ready(&self.http, timeout, || self.logs());
    }

    /// `POST /v1/completions` with `body`; the status and the JSON answer.
    pub fn complete(&self, body: &Value) -> anyhow::Result<(u16, Value)> {
        post(&format!("{}/v1/completions", self.http), body)
    }

    /// Greedy tokens for a token-id prompt (EOS ignored), retrying while the group starts.
    pub fn greedy(
        &self,
        model: &str,
        prompt: &[u32],
        max_tokens: usize,
    ) -> anyhow::Result<Vec<u32>> {
        let body = json!({
            "model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": true, "return_token_ids": true,
        });
        let (status, answer) = self.complete(&body)?;
        if status != 200 {
            bail!("status {status}: {answer}\n{}", self.logs());
        }
        token_ids(&answer)
    }

    /// Every process's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for p in &self.procs {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            let _ = writeln!(out, "---- {} ({})", p.name, p.log.display());
            for line in tail.iter().rev() {
                let _ = writeln!(out, "{line}");
            }
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = killpg(Pid::from_raw(p.child.id() as i32), Signal::SIGKILL);
            let _ = p.child.wait();
        }
    }
}
