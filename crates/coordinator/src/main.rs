//! `tessera-coordinator`: one coordinator peer. Reads the topology, joins the Raft group
//! of the topology's coordinator peers (restarting from its data dir), and while it leads
//! accepts the shards' control connections and drives every group; it serves the HTTP API
//! until SIGTERM or Ctrl-C.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow};
use clap::Parser;
use metrics_exporter_prometheus::PrometheusHandle;
use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::quic;
use tessera_coordinator::api::{self, ApiKeys, ApiState, ServedModel};
use tessera_coordinator::forward::{self, Forwarder};
use tessera_coordinator::group::driver::Limits;
use tessera_coordinator::leader::{Announce, JournalLimits, Leadership};
use tessera_coordinator::replication::transport::{self, Addresses};
use tessera_coordinator::replication::{LogStore, log, membership, node, peer::Peer};
use tessera_coordinator::{metrics, server};
use tessera_model::chat::ChatTemplate;
use tessera_model::loader;
use tessera_topology::{CoordinatorPeer, PeerId, Topology};
use tracing::{error, info, warn};

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

async fn run(args: Args) -> anyhow::Result<()> {
    let journal_limits = args.journal_limits()?;
    let api_keys = ApiKeys::new(args.api_keys).with_admin(args.admin_keys);
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
    tokio::spawn(fail_stop(node.clone()));
    let topology = Arc::new(topology);
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
        Arc::clone(&topology),
        Limits::default(),
        journal_limits,
        announce,
    );
    tokio::spawn(server::accept_loop(
        endpoint.clone(),
        topology,
        leadership.clone(),
    ));

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
    let app = http_app(models, api_keys, leadership, metrics_handle);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("serving HTTP")?;
    endpoint.close(0u32.into(), b"coordinator stopping");
    // What it acknowledged is on disk already; this only ends the thread.
    tokio::task::spawn_blocking(move || node.stop()).await.ok();
    info!("stopped");
    Ok(())
}

/// Exits the process when its Raft peer stops on its own (its store failed): a peer
/// without Raft must not live on answering requests, and a supervisor restarts it from
/// what its data dir holds.
async fn fail_stop(node: node::NodeHandle) {
    let mut failure = node.failure();
    let Ok(reason) = failure.wait_for(Option::is_some).await.map(|r| r.clone()) else {
        return;
    };
    let reason = reason.unwrap_or_default();
    error!(reason, "the raft peer stopped: exiting");
    eprintln!(
        "error: this coordinator peer's Raft stopped ({reason}); exiting so that it restarts \
         from its data dir"
    );
    std::process::exit(RAFT_STOPPED_EXIT);
}

/// The exit status of a peer whose Raft stopped (sysexits' EX_SOFTWARE).
const RAFT_STOPPED_EXIT: i32 = 70;

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
    models: Vec<ServedModel>,
    api_keys: ApiKeys,
    leadership: Leadership,
    metrics_handle: Option<PrometheusHandle>,
) -> axum::Router {
    let mut app = api::router(ApiState {
        models,
        engine: Arc::new(leadership.clone()),
        api_keys,
    })
    .layer(axum::middleware::from_fn_with_state(
        Forwarder::new(leadership),
        forward::forward,
    ));
    if let Some(handle) = metrics_handle {
        app = app.route(
            "/metrics",
            axum::routing::get(move || std::future::ready(handle.render())),
        );
    }
    app
}

/// Tokenizer and limits of every model, read from the model files' metadata (no
/// weights: the coordinator runs no layers).
fn served_models(topology: &Topology) -> anyhow::Result<Vec<ServedModel>> {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    topology
        .models
        .iter()
        .map(|m| {
            let meta = loader::load_metadata(&m.path)
                .with_context(|| format!("reading model `{}` at {}", m.name, m.path.display()))?;
            let mut eos_token_ids = meta.config.eos_token_ids.clone();
            if let Some(t) = &meta.tokenizer {
                eos_token_ids.extend(t.eos_token_ids());
            }
            eos_token_ids.sort_unstable();
            eos_token_ids.dedup();
            let chat_template = meta.tokenizer.as_ref().and_then(|t| {
                ChatTemplate::from_tokenizer(t)
                    .map_err(|error| {
                        // Completions still work; chat answers 400 for this model.
                        warn!(model = %m.name, %error, "chat template does not compile");
                    })
                    .ok()
                    .flatten()
                    .map(Arc::new)
            });
            Ok(ServedModel {
                name: m.name.clone(),
                context_tokens: meta.config.max_position_embeddings,
                vocab_size: meta.config.vocab_size,
                tokenizer: meta.tokenizer.map(Arc::new),
                chat_template,
                eos_token_ids,
                created,
            })
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

async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = terminate => info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: stopping"),
    }
}
