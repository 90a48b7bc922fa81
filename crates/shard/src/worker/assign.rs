//! Taking an assignment: load the slice (once, kept across epochs), join the epoch's
//! collective on host memory, and size the KV cache and warm it up, or carry the last
//! epoch's.
//!
//! An NCCL group joins in steps of its own (`super::nccl`); it ends here too, in
//! [`finish`], once its communicator exists.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_comm::Collective;
use tessera_comm::collective::connect::connect;
use tessera_comm::collective::{CollectiveConfig, CollectiveStats};
#[cfg(feature = "cuda")]
use tessera_comm::nccl::NcclGroup;
use tessera_comm::proto::{Assignment, ModelSource, Ready, ShardMsg, Term};
use tessera_model::ModelConfig;
use tessera_model::llama::LoadProgress;
use tessera_model::loader;
use tessera_model::slice::{ModelSlice, SliceComm};
use tessera_topology::plan_group;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use super::WorkerConfig;
use crate::error::ShardError;
use crate::runner::StepRunner;

/// How often loading progress is reported.
const LOAD_PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// The epoch this rank is serving, under the coordinator term that assigned it.
pub(crate) struct Active {
    pub(crate) term: Term,
    pub(crate) comm: GroupComm,
    pub(crate) runner: StepRunner,
}

/// The collective of an epoch, as this rank owns it.
pub(crate) enum GroupComm {
    /// Shared memory, the TCP ring, or the group of one.
    Host(Box<dyn Collective>),
    /// The group's NCCL communicator (a GPU group); it also serves host buffers.
    #[cfg(feature = "cuda")]
    Nccl(Box<NcclGroup>),
}

impl GroupComm {
    /// The collective as a step takes it.
    pub(crate) fn for_step(&mut self) -> SliceComm<'_> {
        match self {
            GroupComm::Host(comm) => SliceComm::Host(comm.as_mut()),
            #[cfg(feature = "cuda")]
            GroupComm::Nccl(group) => SliceComm::Nccl(group.as_mut()),
        }
    }

    pub(crate) fn stats(&self) -> CollectiveStats {
        match self {
            GroupComm::Host(comm) => comm.stats(),
            #[cfg(feature = "cuda")]
            GroupComm::Nccl(group) => group.stats(),
        }
    }
}

/// Joins a host-memory collective (shared memory, the TCP ring) and says `Ready`.
pub(super) fn join_host(
    config: &WorkerConfig,
    slice: Arc<ModelSlice>,
    assignment: Assignment,
    carried: Option<StepRunner>,
) -> Result<(Active, Ready), ShardError> {
    let comm = connect(
        &assignment.bootstrap,
        config.rank,
        config.tp,
        &assignment.token,
        collective_config(&assignment),
    )?;
    finish(config, slice, assignment, carried, GroupComm::Host(comm))
}

pub(super) fn collective_config(assignment: &Assignment) -> CollectiveConfig {
    CollectiveConfig {
        deadline: Duration::from_millis(assignment.collective_deadline_ms),
        ..CollectiveConfig::default()
    }
}

/// The weights this rank holds: one model version's slice.
pub(crate) struct Loaded {
    pub(crate) source: ModelSource,
    pub(crate) slice: Arc<ModelSlice>,
    /// Fault injection: the planted file found in the model, which fails every step.
    pub(crate) planted_fault: Option<String>,
}

/// The slice of the assignment's model version: the one held, or loaded now (this rank's
/// plan follows from that version's config) and kept for later epochs.
pub(super) fn load_once(
    config: &WorkerConfig,
    model: &mut Option<Loaded>,
    assignment: &Assignment,
    events: &UnboundedSender<ShardMsg>,
) -> Result<Arc<ModelSlice>, ShardError> {
    if let Some(m) = model.as_ref().filter(|m| m.source == assignment.model) {
        return Ok(Arc::clone(&m.slice));
    }
    let source = assignment.model.clone();
    let path = match source.version {
        1 => config.first_version.as_path(),
        _ => Path::new(&source.path),
    };
    let shape = ModelConfig::from_path(path)?.shape();
    let plans = plan_group(config.tp, &shape).map_err(|e| ShardError::Version {
        version: source.version,
        message: e.to_string(),
    })?;
    let plan = &plans[config.rank.0 as usize];
    let epoch = assignment.epoch;
    let started = Instant::now();
    let mut reported = Instant::now();
    let mut on_layer = |p: LoadProgress| {
        // At most a few messages a second, and always the last layer.
        if p.layers_done == p.layers || reported.elapsed() >= LOAD_PROGRESS_EVERY {
            reported = Instant::now();
            info!(
                layers_done = p.layers_done,
                layers = p.layers,
                weight_bytes = p.weight_bytes,
                "loading"
            );
            let _ = events.send(ShardMsg::Loading {
                epoch,
                layers_done: u32::try_from(p.layers_done).unwrap_or(u32::MAX),
                layers: u32::try_from(p.layers).unwrap_or(u32::MAX),
                weight_bytes: p.weight_bytes as u64,
            });
        }
    };
    let mut llama = loader::load_rank_with_progress(path, plan, config.tp, &mut on_layer)?;
    llama.hold_as(config.dtype)?;
    llama.set_precision(config.precision);
    #[cfg(feature = "cuda")]
    let slice = match &config.device {
        Some(device) => ModelSlice::upload(llama, Arc::clone(device))?,
        None => ModelSlice::cpu(llama),
    };
    #[cfg(not(feature = "cuda"))]
    let slice = ModelSlice::cpu(llama);
    let slice = Arc::new(slice);
    info!(
        rank = %config.rank,
        version = source.version,
        weight_bytes = slice.weight_bytes(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "weights loaded"
    );
    let planted_fault = planted(config.step_error_file.as_deref(), path);
    if let Some(file) = &planted_fault {
        warn!(%file, "fault injection: the model holds the planted file, so every step fails");
    }
    *model = Some(Loaded {
        source,
        slice: Arc::clone(&slice),
        planted_fault,
    });
    Ok(slice)
}

/// The planted file's path when the model at `path` (its directory, or the directory of
/// its file) holds a file named `name`.
fn planted(name: Option<&str>, path: &Path) -> Option<String> {
    let dir = if path.is_dir() { path } else { path.parent()? };
    let file = dir.join(name?);
    file.exists().then(|| file.display().to_string())
}

/// Sizes the KV cache and warms it up (or carries the last epoch's and the sequences the
/// assignment keeps) and says `Ready`.
pub(super) fn finish(
    config: &WorkerConfig,
    slice: Arc<ModelSlice>,
    assignment: Assignment,
    carried: Option<StepRunner>,
    mut comm: GroupComm,
) -> Result<(Active, Ready), ShardError> {
    let epoch = assignment.epoch;
    let (runner, kept, warmup_ms) = match carried {
        Some(runner) => {
            let (runner, kept) = runner.carry(epoch, &assignment.keep);
            (runner, kept, None)
        }
        None => {
            let budget = usize::try_from(config.kv_memory_bytes).unwrap_or(usize::MAX);
            let cache = slice.new_cache(budget)?;
            let mut runner = StepRunner::new(config.rank, epoch, cache)
                .with_device_sampling(config.device_sampling);
            let warmup_ms = warm_up(config, &slice, &mut runner, &mut comm, &assignment)?;
            (runner, Vec::new(), warmup_ms)
        }
    };
    let blocks = runner.num_blocks();
    info!(%epoch, rank = %config.rank, kv_blocks = blocks, carried = kept.len(), "joined the group");
    let ready = Ready {
        epoch,
        kv_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        block_size: runner.block_size() as u32,
        weight_bytes: slice.weight_bytes() as u64,
        kept,
        warmup_ms,
    };
    Ok((
        Active {
            term: assignment.term,
            comm,
            runner,
        },
        ready,
    ))
}

/// Runs the assignment's warmup on a new runner; how long it took, in milliseconds
/// (`None` when it asks for none).
fn warm_up(
    config: &WorkerConfig,
    slice: &ModelSlice,
    runner: &mut StepRunner,
    comm: &mut GroupComm,
    assignment: &Assignment,
) -> Result<Option<u64>, ShardError> {
    if assignment.warmup.is_none() {
        return Ok(None);
    }
    let started = Instant::now();
    // A GPU captures a decode graph per batch size: each is decoded once.
    let every_decode_batch = slice.captures_decode_graphs();
    let run = runner.warm_up(
        slice,
        &mut comm.for_step(),
        assignment.warmup,
        every_decode_batch,
    )?;
    let ms = started.elapsed().as_millis() as u64;
    info!(
        epoch = %assignment.epoch,
        rank = %config.rank,
        elapsed_ms = ms,
        steps = run.steps,
        tokens = run.tokens,
        prefill_tokens = run.prefill_tokens,
        decode_seqs = run.decode_seqs,
        "warmed up"
    );
    Ok(Some(ms))
}
