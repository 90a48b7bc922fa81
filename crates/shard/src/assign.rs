//! Taking an assignment: load the slice (once, kept across epochs), join the epoch's
//! collective, and size the KV cache or carry the last epoch's.
//!
//! An NCCL group joins in steps. Rank 0 makes the communicator's unique id, sends it to
//! the coordinator ([`ShardMsg::NcclId`]) and joins; every other rank loads, then waits
//! until the coordinator relays the id, and joins with it. NCCL's join blocks until every
//! rank has joined and has no timeout, so it runs on a thread of its own that reports
//! through the worker's command channel ([`Command::Joined`]): the compute thread stays
//! free to take a newer assignment if the group fails meanwhile (the stale join's result
//! is then dropped, which aborts its communicator).

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use tessera_comm::Collective;
use tessera_comm::collective::connect::connect;
use tessera_comm::collective::{CollectiveConfig, CollectiveError, Op};
use tessera_comm::nccl::{ID_BYTES, NcclError, NcclGroup, unique_id};
use tessera_comm::proto::{Assignment, Bootstrap, Ready, ShardMsg};
use tessera_model::llama::LoadProgress;
use tessera_model::loader;
use tessera_model::slice::ModelSlice;
use tessera_topology::Rank;
use tokio::sync::mpsc::UnboundedSender;
use tracing::info;

use crate::engine::Engine;
use crate::error::ShardError;
use crate::worker::{Command, WorkerConfig};

/// How often loading progress is reported.
const LOAD_PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// The epoch this rank is serving, under the coordinator term that assigned it.
pub(crate) struct Active {
    pub(crate) term: u64,
    pub(crate) comm: Box<dyn Collective>,
    pub(crate) engine: Engine,
}

/// Where an NCCL assignment stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Rank > 0: waiting for rank 0's id.
    AwaitingId,
    /// The join runs on its own thread.
    Joining,
}

/// An NCCL assignment, loaded, not joined yet.
pub(crate) struct PendingNccl {
    pub(crate) assignment: Assignment,
    pub(crate) carried: Option<Engine>,
    pub(crate) stage: Stage,
    model: Arc<ModelSlice>,
}

/// What taking an assignment came to.
pub(crate) enum Joined {
    Ready((Active, Ready)),
    Pending(PendingNccl),
}

/// Loads the slice (once), then joins the assignment's collective, or waits for the NCCL
/// id where that is what the group needs first.
pub(crate) fn assign(
    config: &WorkerConfig,
    model: &mut Option<Arc<ModelSlice>>,
    assignment: Assignment,
    carried: Option<Engine>,
    events: &UnboundedSender<ShardMsg>,
    joins: &Sender<Command>,
) -> Result<Joined, ShardError> {
    let slice = load_once(config, model, assignment.epoch, events)?;
    match assignment.bootstrap {
        Bootstrap::Nccl => {
            let pending = PendingNccl {
                assignment,
                carried,
                stage: Stage::AwaitingId,
                model: slice,
            };
            if config.rank != Rank(0) {
                return Ok(Joined::Pending(pending));
            }
            let id = unique_id().map_err(|e| e.in_op(Op::Connect))?;
            let _ = events.send(ShardMsg::NcclId {
                epoch: pending.assignment.epoch,
                id: id.to_vec(),
            });
            pending.join(config, &id, joins).map(Joined::Pending)
        }
        _ => {
            let comm = connect(
                &assignment.bootstrap,
                config.rank,
                config.tp,
                &assignment.token,
                collective_config(&assignment),
            )?;
            finish(config, slice, assignment, carried, comm).map(Joined::Ready)
        }
    }
}

impl PendingNccl {
    /// Starts joining the group with `id` (rank 0's) on a thread of its own; its result
    /// comes back as [`Command::Joined`].
    pub(crate) fn join(
        mut self,
        config: &WorkerConfig,
        id: &[u8],
        joins: &Sender<Command>,
    ) -> Result<PendingNccl, ShardError> {
        let id: [u8; ID_BYTES] = id.try_into().map_err(|_| CollectiveError::BadLength {
            op: Op::Connect,
            len: id.len(),
            detail: format!("an NCCL unique id is {ID_BYTES} bytes"),
        })?;
        let stream = self
            .model
            .cuda_stream()
            .ok_or_else(|| CollectiveError::Io {
                op: Op::Connect,
                message: "NCCL needs a cuda device; this shard runs on the cpu".into(),
            })?;
        let (rank, world, epoch) = (config.rank, config.tp, self.assignment.epoch);
        let deadline = collective_config(&self.assignment).deadline;
        let joins = joins.clone();
        std::thread::Builder::new()
            .name("nccl-join".into())
            .spawn(move || {
                let group = NcclGroup::join(stream, rank, world, &id, deadline);
                let _ = joins.send(Command::Joined { epoch, group });
            })
            .map_err(|e| CollectiveError::Io {
                op: Op::Connect,
                message: format!("starting the NCCL join: {e}"),
            })?;
        self.stage = Stage::Joining;
        Ok(self)
    }

    /// The joined group: size or carry the cache and say `Ready`.
    pub(crate) fn joined(
        self,
        config: &WorkerConfig,
        group: Result<NcclGroup, NcclError>,
    ) -> Result<(Active, Ready), ShardError> {
        let group = group.map_err(|e| e.in_op(Op::Connect))?;
        finish(
            config,
            self.model,
            self.assignment,
            self.carried,
            Box::new(group),
        )
    }
}

fn collective_config(assignment: &Assignment) -> CollectiveConfig {
    CollectiveConfig {
        deadline: Duration::from_millis(assignment.collective_deadline_ms),
        ..CollectiveConfig::default()
    }
}

/// The slice, loaded on first use and kept for later epochs.
fn load_once(
    config: &WorkerConfig,
    model: &mut Option<Arc<ModelSlice>>,
    epoch: u64,
    events: &UnboundedSender<ShardMsg>,
) -> Result<Arc<ModelSlice>, ShardError> {
    if let Some(m) = model {
        return Ok(Arc::clone(m));
    }
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
    let llama = loader::load_rank_with_progress(
        &config.model_path,
        &config.plan,
        config.tp,
        &mut on_layer,
    )?;
    let loaded = Arc::new(ModelSlice::place(llama, config.device.clone())?);
    info!(
        rank = %config.rank,
        weight_bytes = loaded.weight_bytes(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "weights loaded"
    );
    *model = Some(Arc::clone(&loaded));
    Ok(loaded)
}

/// Sizes the KV cache (or carries the last epoch's and the sequences the assignment
/// keeps) and says `Ready`.
fn finish(
    config: &WorkerConfig,
    slice: Arc<ModelSlice>,
    assignment: Assignment,
    carried: Option<Engine>,
    comm: Box<dyn Collective>,
) -> Result<(Active, Ready), ShardError> {
    let epoch = assignment.epoch;
    let (engine, kept) = match carried {
        Some(engine) => engine.carry(epoch, &assignment.keep),
        None => {
            let budget = usize::try_from(config.kv_memory_bytes).unwrap_or(usize::MAX);
            let cache = slice.new_cache(budget)?;
            (Engine::new(config.rank, epoch, cache), Vec::new())
        }
    };
    let blocks = engine.num_blocks();
    info!(epoch, rank = %config.rank, kv_blocks = blocks, carried = kept.len(), "joined the group");
    let ready = Ready {
        epoch,
        kv_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        block_size: engine.block_size() as u32,
        weight_bytes: slice.weight_bytes() as u64,
        kept,
    };
    Ok((
        Active {
            term: assignment.term,
            comm,
            engine,
        },
        ready,
    ))
}
