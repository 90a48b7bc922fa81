//! `tessera up`: starts every process of a topology that lives on this machine and
//! supervises them until Ctrl-C or SIGTERM.
//!
//! 1. The topology: `--topology FILE`, or one written into the run directory for
//!    `--model PATH --tp N` ([`one_host`]), or for the SmolLM2 demo when neither is given.
//! 2. The topology is checked as `tessera topology check` checks it (errors stop here).
//! 3. Certificates: `<run-dir>/certs` (or `--certs`) is made with
//!    [`tessera_comm::certs::init_cluster`] when it has no `ca.pem`, reused otherwise.
//! 4. The processes of this host ([`local`]) start, each in its own process group, under the
//!    [`supervisor::Supervisor`] (restarts with backoff; on Ctrl-C, coordinators first,
//!    then shards: SIGTERM → grace → SIGKILL), driven
//!    by [`driver`], which also announces the API once `/health` answers.
//!
//! `docs/launcher.md` is the user's guide.

mod driver;
mod local;
mod one_host;
mod supervisor;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tessera_comm::certs::{CA_CERT_FILE, Identity, init_cluster};
use tessera_topology::{NetAddr, Topology};

use crate::topology_cmd;
use driver::{Api, Launch, ME};
use local::{ChildSpec, Paths};
use one_host::OneHost;
use supervisor::Policy;

/// Arguments of `tessera up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Topology file to run: only its processes on this machine start (see --host).
    /// Without it (and without --model), the SmolLM2 demo runs: 3 CPU shards on this host.
    #[arg(long, env = "TESSERA_TOPOLOGY", conflicts_with = "model")]
    pub topology: Option<PathBuf>,
    /// Serve this model (a HuggingFace directory or a .gguf file) on this host, with a
    /// topology written into the run directory.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// Tensor-parallel degree for --model: the number of CPU shards [default: 1].
    #[arg(long, env = "TESSERA_TP", requires = "model")]
    pub tp: Option<usize>,
    /// The name clients ask for with --model [default: the file's stem or the
    /// directory's name].
    #[arg(long, env = "TESSERA_SERVED_MODEL_NAME", requires = "model")]
    pub served_model_name: Option<String>,
    /// Coordinator peers of the written topology (demo or --model): 1, or 3 or 5 for a
    /// Raft group that survives the loss of 1 or 2. Peer 1 serves the HTTP address; the
    /// others the next ports.
    #[arg(long, env = "TESSERA_COORDINATORS", default_value_t = 1, value_parser = coordinator_count, conflicts_with = "topology")]
    pub coordinators: usize,
    /// How the CPU shards of the written topology (demo or --model) multiply: `exact`
    /// (f32 activations, token for token with transformers) or `fast` (8-bit
    /// activations, integer dot products: faster on Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS weights).
    #[arg(
        long,
        env = "TESSERA_PRECISION",
        default_value = "exact",
        conflicts_with = "topology"
    )]
    pub precision: tessera_topology::Precision,
    /// KV cache memory of each shard, with --model.
    #[arg(long, env = "TESSERA_KV_MEMORY", default_value = "256MiB")]
    pub kv_memory: String,
    /// Serve the HTTP API here instead of the topology's address (127.0.0.1:8000 for the
    /// demo and --model).
    #[arg(long, env = "TESSERA_HTTP")]
    pub http: Option<SocketAddr>,
    /// Run the processes of this host of the topology [default: the hosts whose name is
    /// `local` or whose address is this machine's].
    #[arg(long, env = "TESSERA_HOST")]
    pub host: Option<String>,
    /// Directory for the written topology, certificates, coordinator data and logs
    /// (created if missing).
    #[arg(long, env = "TESSERA_RUN_DIR", default_value = "run")]
    pub run_dir: PathBuf,
    /// Certificates directory [default: <run-dir>/certs; made there when it has no ca.pem].
    #[arg(long, env = "TESSERA_CERTS")]
    pub certs: Option<PathBuf>,
    /// Seconds each process has to stop after SIGTERM before SIGKILL. Coordinators stop
    /// first and drain for up to 30 s (their `--drain-timeout`), then the shards.
    #[arg(long, env = "TESSERA_GRACE", default_value_t = 40.0)]
    pub grace: f64,
    /// Where tessera-shard and tessera-coordinator are [default: the directory of this
    /// tessera binary].
    #[arg(long, env = "TESSERA_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Prepare everything (topology, check, certificates), print the command lines, and
    /// start nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// The topology to run and where it came from.
#[derive(Debug)]
struct Source {
    /// The file the processes read.
    path: PathBuf,
    /// Written by `tessera up` (demo or --model).
    written: bool,
}

/// `--coordinators`: 1, 3 or 5 (an even count tolerates no more failures than one less).
fn coordinator_count(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n @ (1 | 3 | 5)) => Ok(n),
        _ => Err(format!(
            "`{text}`: a coordinator group has 1, 3 or 5 peers (a majority must survive)"
        )),
    }
}

/// Runs `tessera up`.
pub fn run(args: &UpArgs) -> anyhow::Result<ExitCode> {
    if !args.grace.is_finite() || args.grace < 0.0 {
        bail!(
            "--grace must be a number of seconds, 0 or more; got {}",
            args.grace
        );
    }
    std::fs::create_dir_all(&args.run_dir)
        .with_context(|| format!("creating the run directory {}", args.run_dir.display()))?;
    let source = topology_source(args)?;
    let Some(topology) = check(&source.path)? else {
        bail!(
            "{}: the topology has errors (above); nothing was started",
            source.path.display()
        );
    };
    let hosts = local::local_hosts(&topology, args.host.as_deref())?;
    if hosts.is_empty() {
        let addresses: Vec<String> = topology
            .hosts
            .iter()
            .map(|h| format!("{} = {}", h.name, h.address))
            .collect();
        bail!(
            "no host of {} is this machine (hosts: {}); pass --host NAME to choose one",
            source.path.display(),
            addresses.join(", ")
        );
    }
    let certs = args
        .certs
        .clone()
        .unwrap_or_else(|| args.run_dir.join("certs"));
    // Absolute, so the printed command lines work from anywhere.
    let certs =
        std::path::absolute(&certs).with_context(|| format!("resolving {}", certs.display()))?;
    let bin_dir = bin_dir(args)?;
    let paths = Paths {
        topology: &source.path,
        certs: &certs,
        bin_dir: &bin_dir,
    };
    let local_coordinators = topology
        .coordinators
        .iter()
        .filter(|c| hosts.contains(&c.host))
        .count();
    if args.http.is_some() && !source.written && local_coordinators != 1 {
        bail!(
            "--http needs exactly one coordinator peer on this host; {} has {local_coordinators}",
            source.path.display()
        );
    }
    // A written topology already has the address in it.
    let http_override = args.http.filter(|_| !source.written);
    let children = local::children(&topology, &hosts, &paths, http_override);
    if children.is_empty() {
        bail!(
            "{} has no coordinator or shard on host(s) {}; nothing to start",
            source.path.display(),
            hosts.join(", ")
        );
    }
    check_models_here(&topology, &hosts)?;
    // The certificates of a written topology are the launcher's own: stale ones are
    // replaced. Certificates given or next to a user's topology are never touched.
    let replace_stale = source.written && args.certs.is_none();
    ensure_certs(&topology, &certs, &children, replace_stale)?;
    let api = api(&topology, &hosts, http_override)?;

    eprintln!(
        "{ME} {} on host(s) {}:",
        count(children.len(), "process"),
        hosts.join(", ")
    );
    for child in &children {
        eprintln!("  {:<16} {}", child.name, child.command_line());
    }
    if args.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    check_binaries(&children, &bin_dir)?;
    if let Some(api) = &api {
        refuse_busy_http(api)?;
    }
    check_data_dirs(&children)?;
    let logs_dir = args.run_dir.join("logs");
    eprintln!(
        "{ME} logs in {}; Ctrl-C stops everything",
        logs_dir.display()
    );
    driver::run(Launch {
        children,
        policy: Policy::with_grace(Duration::from_secs_f64(args.grace)),
        logs_dir,
        env: driver::child_env(),
        api,
    })
}

/// The topology file: the one given, or one written for --model or the demo.
fn topology_source(args: &UpArgs) -> anyhow::Result<Source> {
    if let Some(path) = &args.topology {
        return Ok(Source {
            path: path.clone(),
            written: false,
        });
    }
    let (model, tp, name, group, made_by) = match &args.model {
        Some(model) => {
            if !model.exists() {
                bail!(
                    "--model {}: no such file or directory (a HuggingFace model directory or a \
                     .gguf file)",
                    model.display()
                );
            }
            let tp = args.tp.unwrap_or(1);
            let name = args
                .served_model_name
                .clone()
                .unwrap_or_else(|| one_host::model_name_of(model));
            let made_by = format!("tessera up --model {} --tp {tp}", model.display());
            (model.clone(), tp, name, one_host::group_name(tp), made_by)
        }
        None => {
            let model = PathBuf::from(one_host::DEMO_MODEL);
            if !model.exists() {
                let cwd = std::env::current_dir().unwrap_or_default();
                bail!(
                    "the demo model {} is missing (looked in {}): fetch it with \
                     scripts/get-demo-model.sh from the repository root, and run tessera up \
                     there; or pass --model PATH or --topology FILE",
                    one_host::DEMO_MODEL,
                    cwd.display()
                );
            }
            let made_by = "tessera up (the SmolLM2 demo)".to_owned();
            let (name, group) = (
                one_host::DEMO_NAME.to_owned(),
                one_host::DEMO_GROUP.to_owned(),
            );
            (model, one_host::DEMO_TP, name, group, made_by)
        }
    };
    if tp == 0 {
        bail!("--tp must be at least 1");
    }
    let model_path =
        std::path::absolute(&model).with_context(|| format!("resolving {}", model.display()))?;
    let Some(model_path) = model_path.to_str().map(str::to_owned) else {
        bail!("{}: the model's path is not UTF-8", model_path.display());
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (quic_port, shard_ports) = one_host::pick_ports(tp)?;
    let http = args.http.unwrap_or(one_host::DEFAULT_HTTP);
    let more_coordinators = one_host::more_coordinators(http, args.coordinators - 1)?;
    let one = OneHost {
        model_name: name,
        model_path,
        group,
        tp,
        precision: args.precision,
        threads: one_host::threads_per_shard(cores, tp),
        kv_memory: args.kv_memory.clone(),
        quic_port,
        http,
        more_coordinators,
        shard_ports,
        made_by,
    };
    let path = std::path::absolute(args.run_dir.join("topology.toml"))
        .context("resolving the run directory")?;
    std::fs::write(&path, one.text()).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("{ME} wrote {}", path.display());
    Ok(Source {
        path,
        written: true,
    })
}

/// Checks the file as `tessera topology check` does, printing the plan and every issue
/// to stderr. `None` when it has errors.
fn check(path: &Path) -> anyhow::Result<Option<Topology>> {
    let check_args = topology_cmd::CheckArgs {
        file: path.to_owned(),
        json: false,
        strict: false,
    };
    let (mut out, mut diag) = (std::io::stderr(), std::io::stderr());
    let ok = topology_cmd::check_to(&check_args, &mut out, &mut diag)?;
    if !ok {
        return Ok(None);
    }
    match Topology::read(path) {
        Ok(topology) => Ok(Some(topology)),
        Err(_) => Ok(None),
    }
}

/// Every model a shard of this host serves must be on this host.
fn check_models_here(topology: &Topology, hosts: &[String]) -> anyhow::Result<()> {
    for group in &topology.groups {
        let Some(shard) = group.shards.iter().find(|s| hosts.contains(&s.host)) else {
            continue;
        };
        if let Some(model) = topology.model(&group.model)
            && !model.path.exists()
        {
            bail!(
                "model `{}` is not on this machine ({} does not exist), but shard {}/{} runs \
                 here",
                model.name,
                model.path.display(),
                group.name,
                shard.rank
            );
        }
    }
    Ok(())
}

/// Makes the certificates when `certs` has no CA; otherwise checks that every local
/// process has its certificate there.
fn ensure_certs(
    topology: &Topology,
    certs: &Path,
    children: &[ChildSpec],
    replace_stale: bool,
) -> anyhow::Result<()> {
    let missing = children
        .iter()
        .map(|c| (c, certs.join(format!("{}.pem", c.identity.file_stem()))))
        .find(|(_, cert)| !cert.exists());
    let have_ca = certs.join(CA_CERT_FILE).exists();
    if have_ca && missing.is_some() && replace_stale {
        eprintln!(
            "{ME} the certificates in {} were made for another topology: replacing them",
            certs.display()
        );
        std::fs::remove_dir_all(certs).with_context(|| format!("removing {}", certs.display()))?;
    }
    if !certs.join(CA_CERT_FILE).exists() {
        let summary = init_cluster(topology, certs)
            .with_context(|| format!("creating certificates in {}", certs.display()))?;
        eprintln!(
            "{ME} made a cluster CA and {} in {}",
            count(summary.issued.len(), "certificate"),
            certs.display()
        );
        let everything_here = topology.coordinators.len()
            + topology
                .groups
                .iter()
                .map(|g| g.shards.len())
                .sum::<usize>()
            == children.len();
        if !everything_here {
            eprintln!(
                "{ME} other hosts need these certificates too: copy {} to them (ca.key may \
                 stay here) and pass it with --certs",
                certs.display()
            );
        }
        return Ok(());
    }
    if let Some((child, cert)) = missing {
        bail!(
            "{} has no certificate for {} ({} is missing): it was made for another \
             topology; remove the directory to have new certificates made, or run \
             `tessera certs init` with this topology",
            certs.display(),
            child.identity,
            cert.display()
        );
    }
    eprintln!("{ME} using the certificates in {}", certs.display());
    Ok(())
}

/// `--bin-dir` (or `TESSERA_BIN_DIR`), else the directory of this executable.
fn bin_dir(args: &UpArgs) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &args.bin_dir {
        return Ok(dir.clone());
    }
    let exe = std::env::current_exe().context("finding the tessera executable")?;
    Ok(exe
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf))
}

fn check_binaries(children: &[ChildSpec], bin_dir: &Path) -> anyhow::Result<()> {
    for child in children {
        if !child.program.is_file() {
            bail!(
                "{} not found: build it (cargo build --release -p tessera-shard -p \
                 tessera-coordinator) so it sits next to tessera, or point TESSERA_BIN_DIR \
                 (--bin-dir) at its directory; looked in {}",
                child.program.display(),
                bin_dir.display()
            );
        }
    }
    Ok(())
}

/// Refuses to start anything when a coordinator's data dir holds a configuration that
/// could elect a leader beside the topology's peers (a data dir left by a run with other
/// coordinators): each peer's own `--check` says so, naming both lists and how to
/// reconcile them.
fn check_data_dirs(children: &[ChildSpec]) -> anyhow::Result<()> {
    let coordinators = children
        .iter()
        .filter(|c| matches!(c.identity, Identity::Coordinator(_)));
    for child in coordinators {
        let out = std::process::Command::new(&child.program)
            .args(&child.args)
            .arg("--check")
            .output()
            .with_context(|| format!("running {}", child.program.display()))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            bail!(
                "{}: {}",
                child.name,
                stderr.trim().trim_start_matches("error: ")
            );
        }
    }
    Ok(())
}

/// The API of the first coordinator of this host, reachable from here.
fn api(
    topology: &Topology,
    hosts: &[String],
    http: Option<SocketAddr>,
) -> anyhow::Result<Option<Api>> {
    let Some(peer) = topology
        .coordinators
        .iter()
        .find(|c| hosts.contains(&c.host))
    else {
        eprintln!("{ME} no coordinator runs on this host: the API is on another one");
        return Ok(None);
    };
    let address = match http {
        Some(addr) => NetAddr {
            host: addr.ip().to_string(),
            port: addr.port(),
        },
        None => peer.http.clone(),
    };
    // Every interface includes loopback: ask there.
    let host = match address.ip() {
        Some(IpAddr::V4(ip)) if ip.is_unspecified() => Ipv4Addr::LOCALHOST.to_string(),
        Some(IpAddr::V6(ip)) if ip.is_unspecified() => Ipv6Addr::LOCALHOST.to_string(),
        _ => address.host.clone(),
    };
    let reachable = NetAddr {
        host,
        port: address.port,
    };
    let model = topology
        .models
        .first()
        .map_or_else(|| "MODEL".to_owned(), |m| m.name.clone());
    Ok(Some(Api {
        url: format!("http://{reachable}"),
        model,
    }))
}

/// Something already answering at the API's address is another cluster (or another
/// `tessera up`): starting would only make the coordinator fail to bind.
fn refuse_busy_http(api: &Api) -> anyhow::Result<()> {
    let Some(authority) = api.url.strip_prefix("http://") else {
        return Ok(());
    };
    let Ok(mut addrs) = std::net::ToSocketAddrs::to_socket_addrs(authority) else {
        return Ok(());
    };
    if let Some(addr) = addrs.next()
        && TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
    {
        bail!(
            "something already listens on {authority} (another tessera up?): stop it, or \
             pass --http ADDR"
        );
    }
    Ok(())
}

fn count(n: usize, what: &str) -> String {
    match (n, what) {
        (1, _) => format!("1 {what}"),
        (_, w) if w.ends_with('s') => format!("{n} {what}es"),
        _ => format!("{n} {what}s"),
    }
}
