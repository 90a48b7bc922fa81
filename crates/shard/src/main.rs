//! `tessera-shard`: one rank of a tensor-parallel group. Reads the topology, connects to
//! the coordinator and serves step plans until told to stop (SIGTERM, Ctrl-C or the
//! coordinator's `Shutdown`).

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;

use anyhow::{Context, anyhow};
use clap::Parser;
use tessera_comm::certs::{Credentials, Identity};
#[cfg(feature = "cuda")]
use tessera_kernels::cuda::{CudaDevice, PtxCache};
use tessera_model::ModelConfig;
use tessera_shard::control::{self, ControlConfig};
use tessera_shard::pinning::{self, Pinning};
use tessera_shard::stats::{self, StatsSampler};
use tessera_shard::worker::{self, WorkerConfig};
#[cfg(feature = "cuda")]
use tessera_topology::Device;
use tessera_topology::{Rank, Topology, plan_group};
use tracing::{info, warn};

/// One rank of a Tessera tensor-parallel group.
#[derive(Debug, Parser)]
#[command(name = "tessera-shard", version, about)]
struct Args {
    /// The cluster's topology file.
    #[arg(long, env = "TESSERA_TOPOLOGY")]
    topology: PathBuf,
    /// The group this shard belongs to.
    #[arg(long, env = "TESSERA_GROUP")]
    group: String,
    /// This shard's rank in its group.
    #[arg(long, env = "TESSERA_RANK")]
    rank: u32,
    /// Directory with `ca.pem` and this shard's certificate (`tessera certs init`).
    #[arg(long, env = "TESSERA_CERTS")]
    certs: PathBuf,
    /// Sample on the GPU, where this shard is the `cuda:N` rank of a one-rank group: only
    /// token ids cross to the host, and logits only for requests that want logprobs or
    /// use penalties. Off (`0`, every row sampled on the host from its logits) until a GPU
    /// run has checked the kernel against the host sampler.
    #[arg(
        long,
        env = "TESSERA_DEVICE_SAMPLING",
        default_value = "0",
        value_parser = clap::builder::BoolishValueParser::new(),
        action = clap::ArgAction::Set
    )]
    device_sampling: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let log = std::env::var("TESSERA_LOG").ok();
    tessera_comm::logging::init(log.as_deref(), "info");
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let topology = Topology::read(&args.topology)?;
    let rank = Rank(args.rank);
    let group = topology.group(&args.group).ok_or_else(|| {
        anyhow!(
            "group `{}` is not in {}",
            args.group,
            args.topology.display()
        )
    })?;
    let shard = group.shards.get(rank.0 as usize).ok_or_else(|| {
        anyhow!(
            "group `{}` has {} ranks; there is no rank {rank}",
            group.name,
            group.tp
        )
    })?;
    tessera_shard::check_device_built(shard.device, cfg!(feature = "cuda"))
        .map_err(|e| anyhow!("group `{}` rank {rank}: {e}", group.name))?;
    #[cfg(feature = "cuda")]
    let device = match shard.device {
        Device::Cuda(ordinal) => {
            let cache = PtxCache::new(PtxCache::default_dir());
            let device = CudaDevice::open(ordinal as usize, &cache)
                .with_context(|| format!("group `{}` rank {rank}: {}", group.name, shard.device))?;
            info!(
                device = %shard.device,
                name = device.name(),
                capability = ?device.capability(),
                total_memory = device.total_memory(),
                "device opened, kernels loaded"
            );
            Some(std::sync::Arc::new(device))
        }
        Device::Cpu => None,
    };
    let model = topology
        .model(&group.model)
        .ok_or_else(|| anyhow!("model `{}` is not in the topology", group.model))?;
    let config = ModelConfig::from_path(&model.path)
        .with_context(|| format!("reading model `{}`", model.name))?;
    // The topology's model must slice for this group; each assignment's version is
    // sliced as it is loaded.
    plan_group(group.tp, &config.shape()).map_err(|e| anyhow!("group `{}`: {e}", group.name))?;
    let mut pool = rayon::ThreadPoolBuilder::new().num_threads(shard.threads.max(1));
    if let Some(cores) = pin_to(&topology, &group.name, rank) {
        pool = pool.start_handler(move |i| {
            if let Err(error) = pinning::pin_current_thread(cores[i % cores.len()]) {
                warn!(%error, thread = i, "a compute thread could not be pinned");
            }
        });
    }
    pool.build_global()
        .context("starting the compute threads")?;
    let credentials = Credentials::load(
        &args.certs,
        &Identity::Shard {
            group: group.name.clone(),
            rank,
        },
    )?;
    info!(group = %group.name, rank = %rank, tp = group.tp, model = %model.name, "starting");

    #[cfg(feature = "cuda")]
    let sampler = device
        .as_deref()
        .map_or_else(StatsSampler::cpu, StatsSampler::cuda);
    #[cfg(not(feature = "cuda"))]
    let sampler = StatsSampler::cpu();
    let (command_tx, command_rx) = mpsc::channel();
    let (event_tx, event_rx) = tokio::sync::mpsc::unbounded_channel();
    let stats_tx = event_tx.clone();
    let worker_config = WorkerConfig {
        rank,
        tp: group.tp,
        dtype: model.dtype,
        precision: group.precision,
        first_version: model.path.clone(),
        kv_memory_bytes: shard.kv_memory_bytes,
        #[cfg(feature = "cuda")]
        device,
        device_sampling: args.device_sampling,
        step_delay: fault_step_delay()?,
        step_error_file: std::env::var("TESSERA_FAULT_STEP_ERROR_FILE").ok(),
    };
    std::thread::Builder::new()
        .name("compute".into())
        .spawn({
            let joins = command_tx.clone();
            move || worker::run(worker_config, command_rx, joins, event_tx)
        })
        .context("starting the compute thread")?;
    let control = ControlConfig {
        group: group.name.clone(),
        rank,
        device: shard.device.to_string(),
        coordinators: topology
            .coordinators
            .iter()
            .map(|c| (c.id, c.quic.to_string()))
            .collect(),
        credentials,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .context("installing the SIGTERM handler")?;
        tokio::spawn(stats::report(sampler, stats_tx));
        tokio::select! {
            result = control::run(control, command_tx, event_rx) => Ok(result?),
            _ = terminate.recv() => { info!("SIGTERM: exiting"); Ok(()) }
            _ = tokio::signal::ctrl_c() => { info!("interrupted: exiting"); Ok(()) }
        }
    })
}

/// `TESSERA_FAULT_STEP_DELAY_MS`: a fault-injection knob for tests that need a slow
/// shard (a generation long enough to kill a process in the middle of it).
/// The cores for this shard's compute threads ([`pinning::plan`]), or `None` to leave them
/// unpinned (said in the log); `TESSERA_PIN_THREADS=0` turns pinning off, for a host where
/// other work shares the cores.
fn pin_to(topology: &Topology, group: &str, rank: Rank) -> Option<Vec<usize>> {
    if std::env::var("TESSERA_PIN_THREADS").is_ok_and(|v| v == "0") {
        info!("compute threads not pinned (TESSERA_PIN_THREADS=0)");
        return None;
    }
    let allowed = match pinning::allowed_cores() {
        Ok(allowed) => allowed,
        Err(error) => {
            warn!(%error, "this process's cores are unknown: compute threads not pinned");
            return None;
        }
    };
    match pinning::plan(topology, group, rank, &allowed) {
        Pinning::Cores(cores) => {
            info!(?cores, "compute threads pinned, one core each");
            Some(cores)
        }
        Pinning::Oversubscribed { threads, cores } => {
            info!(
                threads,
                cores,
                "the host's cpu shards ask for more threads than it has cores: compute threads not pinned"
            );
            None
        }
        Pinning::None => None,
    }
}

fn fault_step_delay() -> anyhow::Result<std::time::Duration> {
    match std::env::var("TESSERA_FAULT_STEP_DELAY_MS") {
        Ok(ms) => {
            let ms: u64 = ms
                .parse()
                .with_context(|| format!("TESSERA_FAULT_STEP_DELAY_MS={ms} is not a number"))?;
            tracing::warn!(ms, "fault injection: every step is delayed");
            Ok(std::time::Duration::from_millis(ms))
        }
        Err(_) => Ok(std::time::Duration::ZERO),
    }
}
