//! `tessera-coordinator`: one coordinator peer. Reads the topology, joins the Raft group
//! of the topology's coordinator peers (restarting from its data dir), and while it leads
//! accepts the shards' control connections and drives every group; it serves the HTTP API
//! until SIGTERM or Ctrl-C, and then drains ([`lifecycle`]).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::Parser;
use metrics_exporter_prometheus::PrometheusHandle;
use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::quic;
use tessera_coordinator::api::drain::{self, Drain};
use tessera_coordinator::api::listen::{self, ConnLimits};
use tessera_coordinator::api::{self, ApiKeys, ApiLimits, ApiState, ServedModel, ServedModels};
use tessera_coordinator::canary::CanaryArgs;
use tessera_coordinator::forward::{self, Forwarder};
use tessera_coordinator::group::driver::{Limits, WarmupMode};
use tessera_coordinator::leader::{Announce, JournalLimits, Leadership};
use tessera_coordinator::live::LiveTopology;
use tessera_coordinator::replication::transport::{self, Addresses};
use tessera_coordinator::replication::{LogStore, log, membership, node, peer::Peer};
use tessera_coordinator::{lifecycle, metrics, server};
use tessera_topology::{CoordinatorPeer, PeerId, Topology};
use tracing::{info, warn};

/// A Tessera coordinator peer.
#[derive(Debug, Parser)]
#[command(name = "tessera-coordinator", version, about)]
struct Args {
    /// The cluster's topology file.
    #[arg(long, env = "TESSERA_TOPOLOGY")]
    topology: PathBuf,
    /// This peer's id in the topology's `[[coordinator]]` list.
    #[arg(long, env = "TESSERA_PEER", default_value_t = 1)]
    peer: u64,
    /// Directory with `ca.pem` and this peer's certificate (`tessera certs init`).
    #[arg(long, env = "TESSERA_CERTS")]
    certs: PathBuf,
    /// Serve the HTTP API here instead of the topology's `http` address.
    #[arg(long, env = "TESSERA_HTTP")]
    http: Option<SocketAddr>,
    /// An API key clients must send as `Authorization: Bearer <key>`; repeat for several.
    /// `TESSERA_API_KEYS` takes a comma-separated list. Required unless the HTTP API
    /// listens on a loopback address only.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "TESSERA_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    api_keys: Vec<String>,
    /// A key that may also change the cluster (add or remove coordinator peers), which
    /// API keys may not; repeat for several. `TESSERA_ADMIN_KEYS` takes a comma-separated
    /// list. With API keys and no admin key, the cluster cannot be changed through the API.
    #[arg(
        long = "admin-key",
        value_name = "KEY",
        env = "TESSERA_ADMIN_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    admin_keys: Vec<String>,
    /// Join a running cluster: start with no configuration and wait for the leader
    /// (after `tessera cluster add`), instead of bootstrapping one from the topology's
    /// peers. Ignored when the data dir holds a configuration already.
    #[arg(long)]
    join: bool,
    /// The Raft log and snapshots: the topology's `data_dir` of this peer by default.
    #[arg(long, env = "TESSERA_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// MiB the replicated request journal may hold (a running request is counted at its
    /// largest: prompt plus max_tokens). New requests past it get 503 and `Retry-After`
    /// while running ones fill it. Every peer should have the same.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    journal_budget_mib: u64,
    /// Seconds finished requests stay in the journal, for clients that reconnect late
    /// (fewer when the budget needs their room).
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    journal_retention: u64,
    /// Seconds a request may stay open in the journal before it is dropped.
    #[arg(long, value_name = "SECONDS", default_value_t = 3600)]
    journal_open_ttl: u64,
    /// Check that this peer's data dir holds no configuration other than the topology's
    /// peers, and exit: `tessera up` runs this before it starts anything.
    #[arg(long)]
    check: bool,
    /// Seconds a drain (SIGTERM, `tessera drain`) waits for the requests in flight before
    /// the peer hands leadership over and exits; what still runs then is cut, and stays
    /// in the journal for the next leader.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_DRAIN_TIMEOUT",
        default_value_t = 30.0
    )]
    drain_timeout: f64,
    /// When a group's shards warm up on a new KV cache before they say ready: a prefill
    /// of the step budget, then decodes of the running limit (on a GPU, of every batch
    /// size a decode graph is captured for). `auto`: when a shard of the group is on a
    /// GPU. `/ready` waits for every group's warmup.
    #[arg(long, value_enum, env = "TESSERA_WARMUP", default_value_t = WarmupMode::Auto)]
    warmup: WarmupMode,
    #[command(flatten)]
    limits: LimitArgs,
    #[command(flatten)]
    canary: CanaryArgs,
}

/// What one peer takes on before it sheds load (see docs/api.md, "Limits"). Zero turns a
/// count or rate limit off.
#[derive(Debug, clap::Args)]
struct LimitArgs {
    /// HTTP connections open at once; one more gets 503 and is closed.
    #[arg(long, env = "TESSERA_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Seconds a request's headers may take to arrive (a keep-alive connection's idle
    /// time included).
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_HEADER_TIMEOUT",
        default_value_t = 30.0
    )]
    header_timeout: f64,
    /// Seconds a request's body may take to arrive (408 after).
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_BODY_TIMEOUT",
        default_value_t = 30.0
    )]
    body_timeout: f64,
    /// Completion requests (streams and resumes included) served at once; more get 429.
    #[arg(long, env = "TESSERA_MAX_IN_FLIGHT", default_value_t = 2048)]
    max_in_flight: usize,
    /// The same, for each API key.
    #[arg(long, env = "TESSERA_MAX_IN_FLIGHT_PER_KEY", default_value_t = 0)]
    max_in_flight_per_key: usize,
    /// Requests per second each API key may start, on average; more get 429 with the
    /// Retry-After at which the next one fits.
    #[arg(long, env = "TESSERA_RATE_PER_KEY", default_value_t = 0.0)]
    rate_per_key: f64,
    /// Requests a key may start at once after a pause (default: one second's worth).
    #[arg(long, env = "TESSERA_RATE_BURST")]
    rate_burst: Option<f64>,
    /// Seconds a response may wait for its client to read; then the connection is closed,
    /// and a stream's sequence cancelled with its KV freed.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_WRITE_TIMEOUT",
        default_value_t = 30.0
    )]
    write_timeout: f64,
    /// Seconds a request may wait in a busy group's queue; then it gets 429.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_QUEUE_TIMEOUT",
        default_value_t = 30.0
    )]
    queue_timeout: f64,
    /// An API key that may also run requests ahead of the default priority (`priority`
    /// below 0), which preempts other requests; repeat for several. `TESSERA_PRIORITY_KEYS`
    /// takes a comma-separated list. Admin keys may too.
    #[arg(
        long = "priority-key",
        value_name = "KEY",
        env = "TESSERA_PRIORITY_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    priority_keys: Vec<String>,
}

impl LimitArgs {
    fn api(&self) -> anyhow::Result<ApiLimits> {
        if !(self.rate_per_key >= 0.0 && self.rate_per_key.is_finite()) {
            return Err(anyhow!("--rate-per-key must be a number of 0 or more"));
        }
        let rate_burst = self.rate_burst.unwrap_or(self.rate_per_key);
        if !(rate_burst >= 0.0 && rate_burst.is_finite()) {
            return Err(anyhow!("--rate-burst must be a number of 0 or more"));
        }
        Ok(ApiLimits {
            max_in_flight: self.max_in_flight,
            max_in_flight_per_key: self.max_in_flight_per_key,
            rate_per_key: self.rate_per_key,
            rate_burst,
            body_timeout: seconds("--body-timeout", self.body_timeout)?,
        })
    }

    fn connections(&self) -> anyhow::Result<ConnLimits> {
        if self.max_connections == 0 {
            return Err(anyhow!("--max-connections must be at least 1"));
        }
        Ok(ConnLimits {
            max_connections: self.max_connections,
            header_timeout: seconds("--header-timeout", self.header_timeout)?,
            write_timeout: seconds("--write-timeout", self.write_timeout)?,
        })
    }
}

/// A positive duration from a flag's seconds.
fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow!("{flag} must be a positive number of seconds; got {value}"))
}

impl Args {
    fn journal_limits(&self) -> anyhow::Result<JournalLimits> {
        let limits = JournalLimits {
            budget: self.journal_budget_mib.saturating_mul(1 << 20),
            retention: Duration::from_secs(self.journal_retention),
            open_ttl: Duration::from_secs(self.journal_open_ttl),
        };
        limits.check().map_err(|e| anyhow!("--journal-*: {e}"))?;
        Ok(limits)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let log = std::env::var("TESSERA_LOG").ok();
    tessera_comm::logging::init(log.as_deref(), "info");
    #[cfg(feature = "failpoints")]
    let _failpoints = failpoints();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(error) => {
            eprintln!("error: starting the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Feature `failpoints` (tests only): the failpoints `FAILPOINTS` sets at start, and those
/// of the file `TESSERA_FAILPOINTS_FILE` names, read again whenever its text changes
/// (`name=actions;…`, the `fail` crate's syntax; an empty or missing file removes them), so
/// that a test can stall this peer's disk (`raft::before_persist=sleep(1500)`) for a while
/// and heal it without a restart.
#[cfg(feature = "failpoints")]
fn failpoints() -> fail::FailScenario<'static> {
    let scenario = fail::FailScenario::setup();
    let Some(path) = std::env::var_os("TESSERA_FAILPOINTS_FILE") else {
        return scenario;
    };
    info!(path = %Path::new(&path).display(), "failpoints: watching");
    std::thread::spawn(move || {
        let mut applied = String::new();
        let mut names: Vec<String> = Vec::new();
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text != applied {
                for name in names.drain(..) {
                    fail::remove(name);
                }
                for spec in text.split(';').filter(|s| !s.trim().is_empty()) {
                    let Some((name, actions)) = spec.split_once('=') else {
                        warn!(spec, "failpoints: not name=actions");
                        continue;
                    };
                    match fail::cfg(name.trim(), actions.trim()) {
                        Ok(()) => names.push(name.trim().to_string()),
                        Err(error) => warn!(spec, error, "failpoints: refused"),
                    }
                }
                info!(failpoints = text.trim(), "failpoints: set");
                applied = text;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    scenario
}

async fn run(args: Args) -> anyhow::Result<()> {
    let journal_limits = args.journal_limits()?;
    let canary = args.canary.thresholds().map_err(anyhow::Error::msg)?;
    let api_limits = args.limits.api()?;
    let conn_limits = args.limits.connections()?;
    let group_limits = Limits {
        queue_timeout: seconds("--queue-timeout", args.limits.queue_timeout)?,
        warmup: args.warmup,
        ..Limits::default()
    };
    let api_keys = ApiKeys::new(args.api_keys)
        .with_priority(args.limits.priority_keys)
        .with_admin(args.admin_keys);
    let metrics_handle = metrics::install();
    let topology = Topology::read(&args.topology)?;
    let me = this_peer(&topology, PeerId(args.peer))?;
    let data_dir = args.data_dir.clone().unwrap_or_else(|| me.data_dir.clone());
    check_data_dir(&topology, &me, &data_dir, args.join)?;
    if args.check {
        eprintln!(
            "coordinator peer {}: data dir {} is consistent",
            me.id,
            data_dir.display()
        );
        return Ok(());
    }
    // Before anything starts: an API open to other hosts needs a key.
    let http_addr = match args.http {
        Some(addr) => addr,
        None => resolve(&me.http.to_string()).await?,
    };
    api::check_exposure(http_addr, &api_keys)?;
    let credentials = Credentials::load(&args.certs, &Identity::Coordinator(me.id))?;
    let models = served_models(&topology)?;

    let quic_addr = resolve(&me.quic.to_string()).await?;
    let endpoint = quic::server_endpoint(quic_addr, &credentials)?;

    let node = start_raft(&topology, &me, &data_dir, args.join, &endpoint)?;
    tokio::spawn(lifecycle::fail_stop(node.clone()));
    tokio::spawn(metrics::export_raft(node.clone()));
    tokio::spawn(metrics::export_process());
    let topology = LiveTopology::new(topology);
    topology.follow(node.clone());
    let models = Arc::new(ServedModels::new(models));
    tokio::spawn(api::models::follow(topology.clone(), Arc::clone(&models)));
    let announce = Announce {
        http: args
            .http
            .map_or_else(|| me.http.to_string(), |a| a.to_string()),
        quic: me.quic.to_string(),
        pid: std::process::id(),
    };
    let leadership = Leadership::start(
        me.id,
        node.clone(),
        topology.clone(),
        group_limits,
        journal_limits,
        canary,
        announce,
    );

    let listener = tokio::net::TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("binding the HTTP API to {http_addr}"))?;
    info!(
        peer = me.id.0,
        quic = %quic_addr,
        http = %http_addr,
        data_dir = %data_dir.display(),
        "coordinator started"
    );
    raise_open_files(conn_limits.max_connections);
    let drain = Drain::new(seconds("--drain-timeout", args.drain_timeout)?);
    let app = http_app(
        models,
        api_keys,
        api_limits,
        Arc::clone(&drain),
        leadership.clone(),
        &endpoint,
        metrics_handle,
    );
    tokio::spawn(server::accept_loop(
        endpoint.clone(),
        topology,
        leadership,
        forward::tunnel::serve(app.clone()),
    ));
    let stopping = lifecycle::until_drained(drain, node.clone());
    listen::serve(listener, app, conn_limits, stopping).await;
    endpoint.close(0u32.into(), b"coordinator stopping");
    // What it acknowledged is on disk already; this only ends the thread.
    tokio::task::spawn_blocking(move || node.stop()).await.ok();
    info!("stopped");
    Ok(())
}

/// File descriptors a peer needs besides its HTTP connections: the Raft store, QUIC,
/// logs, and forwarding.
const OTHER_FILES: u64 = 256;

/// Raises the soft limit of open files to the hard one, as servers do, and warns when even
/// that cannot hold `max_connections`: the accept loop would then fail with EMFILE first.
fn raise_open_files(max_connections: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    // Unlimited is `None`; a soft limit is never above the hard one.
    if limit.current.is_some() && limit.current != limit.maximum {
        limit.current = limit.maximum;
        if let Err(error) = setrlimit(Resource::Nofile, limit) {
            warn!(%error, "raising the limit of open files failed");
        }
    }
    let soft = getrlimit(Resource::Nofile).current;
    let needed = max_connections as u64 + OTHER_FILES;
    if let Some(soft) = soft.filter(|&soft| soft < needed) {
        warn!(
            open_files = soft,
            max_connections,
            "the limit of open files is below --max-connections plus {OTHER_FILES}: lower \
             --max-connections or raise the limit (ulimit -n)"
        );
    }
}

/// This process's entry in the topology's `[[coordinator]]` list.
fn this_peer(topology: &Topology, peer: PeerId) -> anyhow::Result<CoordinatorPeer> {
    let me = topology
        .coordinators
        .iter()
        .find(|c| c.id == peer)
        .ok_or_else(|| anyhow!("coordinator peer {peer} is not in the topology"))?;
    Ok(me.clone())
}

/// Refuses a data dir whose stored configuration is not the topology's peers (a peer
/// joining with `--join` takes its configuration from the leader), without creating it.
fn check_data_dir(
    topology: &Topology,
    me: &CoordinatorPeer,
    data_dir: &Path,
    join: bool,
) -> anyhow::Result<()> {
    let path = data_dir.join("raft.redb");
    if join || !path.exists() {
        return Ok(());
    }
    let store = LogStore::open(&path)
        .with_context(|| format!("opening the Raft log in {}", data_dir.display()))?;
    let listed: Vec<PeerId> = topology.coordinators.iter().map(|c| c.id).collect();
    membership::check(me.id, data_dir, &store.voters(), &listed)?;
    Ok(())
}

/// Opens this peer's Raft log in `data_dir` and starts its Raft thread, its messages
/// going over `endpoint`. Without `join`, a fresh log is bootstrapped with the
/// topology's peers as voters; members that join later are dialed as they announce
/// themselves.
fn start_raft(
    topology: &Topology,
    me: &CoordinatorPeer,
    data_dir: &Path,
    join: bool,
    endpoint: &quinn::Endpoint,
) -> anyhow::Result<node::NodeHandle> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the data dir {}", data_dir.display()))?;
    let store = LogStore::open(&data_dir.join("raft.redb"))
        .with_context(|| format!("opening the Raft log in {}", data_dir.display()))?;
    let voters: Vec<PeerId> = if join {
        Vec::new()
    } else {
        topology.coordinators.iter().map(|c| c.id).collect()
    };
    let peer = Peer::start(me.id, &voters, store, rand::random(), &log::logger(me.id))
        .context("starting the Raft peer")?;
    let addresses: Addresses = Arc::new(std::sync::RwLock::new(
        topology
            .coordinators
            .iter()
            .map(|c| (c.id, c.quic.to_string()))
            .collect(),
    ));
    let node = transport::start(peer, endpoint.clone(), Arc::clone(&addresses))
        .context("starting the Raft thread")?;
    tokio::spawn(follow_members(node.clone(), addresses));
    Ok(node)
}

/// The HTTP API over `leadership` (followers forward to the leader), and `/metrics`
/// when the recorder is installed.
fn http_app(
    models: Arc<ServedModels>,
    api_keys: ApiKeys,
    limits: ApiLimits,
    drain: Arc<Drain>,
    leadership: Leadership,
    endpoint: &quinn::Endpoint,
    metrics_handle: Option<PrometheusHandle>,
) -> axum::Router {
    let mut app = api::router(ApiState {
        models,
        engine: Arc::new(leadership.clone()),
        api_keys,
        limits,
        drain: Arc::clone(&drain),
    })
    .layer(axum::middleware::from_fn_with_state(
        Forwarder::new(leadership, endpoint.clone()),
        forward::forward,
    ))
    // In front of forwarding: a draining peer forwards nothing new.
    .layer(axum::middleware::from_fn_with_state(drain, drain::admit));
    if let Some(handle) = metrics_handle {
        app = app.route(
            "/metrics",
            axum::routing::get(move || std::future::ready(handle.render())),
        );
    }
    app
}

/// Tokenizer and limits of every model of the topology.
fn served_models(topology: &Topology) -> anyhow::Result<Vec<ServedModel>> {
    (topology.models.iter())
        .map(|m| {
            api::models::load(m)
                .with_context(|| format!("reading model `{}` at {}", m.name, m.path.display()))
        })
        .collect()
}

/// Dials members that joined after start at the addresses they announced.
async fn follow_members(node: node::NodeHandle, addresses: Addresses) {
    let mut summary = node.summary();
    loop {
        {
            let members = summary.borrow_and_update();
            let mut known = addresses.write().unwrap_or_else(|e| e.into_inner());
            for (id, member) in &members.members {
                if !member.quic.is_empty() {
                    known.insert(*id, member.quic.clone());
                }
            }
        }
        if summary.changed().await.is_err() {
            return;
        }
    }
}

async fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    tokio::net::lookup_host(addr)
        .await
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("{addr} resolves to no address"))
}
