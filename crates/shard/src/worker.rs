//! The compute thread of a shard: owns the model slice, the collective and the
//! [`Engine`] of the current epoch. The control task sends it [`Command`]s and relays
//! its [`ShardMsg`]s to the coordinator.
//!
//! Weights outlive epochs: after a failure the thread drops the collective and the KV
//! cache, keeps the model, and waits for the next `Assign`. Without a failure (the
//! coordinator leader changed), the cache and the sequences an `Assign` names in `keep`
//! carry into the new epoch.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvError};
use std::time::{Duration, Instant};

use tessera_comm::Collective;
use tessera_comm::collective::CollectiveConfig;
use tessera_comm::collective::connect::connect;
use tessera_comm::proto::{Assignment, HeldSeq, Ready, ShardMsg, StepDone, StepPlan, StepTimings};
use tessera_kernels::cuda::CudaDevice;
use tessera_model::llama::LoadProgress;
use tessera_model::loader;
use tessera_model::slice::ModelSlice;
use tessera_topology::{Rank, RankPlan};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::{debug, debug_span, info, warn};

use crate::engine::Engine;
use crate::error::ShardError;

/// How often loading progress is reported.
const LOAD_PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// What the control task asks of the compute thread.
#[derive(Debug)]
pub enum Command {
    Assign(Assignment),
    Step(StepPlan),
    /// The journaled sequences held now, for a registration (answered after every
    /// command sent before it, so the report is final for the old connection).
    Held(oneshot::Sender<Vec<HeldSeq>>),
}

/// What a shard is, for the whole life of the process.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub rank: Rank,
    pub tp: usize,
    pub model_path: PathBuf,
    pub plan: RankPlan,
    pub kv_memory_bytes: u64,
    /// The GPU this rank runs on (`None`: the CPU).
    pub device: Option<Arc<CudaDevice>>,
    /// Fault injection for tests: sleep this long before every step (a slow shard).
    pub step_delay: Duration,
}

/// The epoch this rank is serving, under the coordinator term that assigned it.
struct Active {
    term: u64,
    comm: Box<dyn Collective>,
    engine: Engine,
}

/// Term fencing: a shard follows the newest coordinator leader it has heard from. An
/// assignment from an older Raft term comes from a deposed leader and is ignored, so that
/// leader can no longer drive this shard.
#[derive(Debug, Default)]
struct TermFence {
    newest: u64,
}

impl TermFence {
    /// Whether an assignment of `term` may be taken; taking it raises the fence.
    fn admit(&mut self, term: u64) -> bool {
        if term < self.newest {
            return false;
        }
        self.newest = term;
        true
    }
}

/// Runs until the command channel closes.
pub fn run(config: WorkerConfig, commands: Receiver<Command>, events: UnboundedSender<ShardMsg>) {
    let mut model: Option<Arc<ModelSlice>> = None;
    let mut active: Option<Active> = None;
    let mut last_step_end: Option<Instant> = None;
    let mut fence = TermFence::default();
    loop {
        let waiting = Instant::now();
        let command = match commands.recv() {
            Ok(command) => command,
            Err(RecvError) => return,
        };
        match command {
            Command::Assign(assignment) => {
                if !fence.admit(assignment.term) {
                    warn!(
                        term = assignment.term,
                        newest = fence.newest,
                        "assignment from a deposed coordinator leader ignored"
                    );
                    continue;
                }
                // The old epoch's collective goes first, and its cache unless sequences
                // carry over: the memory is needed.
                let carried = active
                    .take()
                    .map(|a| a.engine)
                    .filter(|_| !assignment.keep.is_empty());
                last_step_end = None;
                let epoch = assignment.epoch;
                match assign(&config, &mut model, assignment, carried, &events) {
                    Ok((next, ready)) => {
                        active = Some(next);
                        let _ = events.send(ShardMsg::Ready(ready));
                    }
                    Err(error) => {
                        warn!(epoch, %error, "assignment failed");
                        let error = error.to_wire(config.rank);
                        let _ = events.send(ShardMsg::Failed { epoch, error });
                    }
                }
            }
            Command::Held(reply) => {
                let held = active
                    .as_ref()
                    .map(|a| a.engine.journaled_held())
                    .unwrap_or_default();
                let _ = reply.send(held);
            }
            Command::Step(plan) => {
                let (Some(model), Some(current)) = (model.as_ref(), active.as_mut()) else {
                    debug!(
                        epoch = plan.epoch,
                        step = plan.step,
                        "plan without an active epoch"
                    );
                    continue;
                };
                if plan.term != current.term || plan.epoch != current.engine.epoch() {
                    debug!(
                        term = plan.term,
                        epoch = plan.epoch,
                        step = plan.step,
                        "plan of another term or epoch"
                    );
                    continue;
                }
                let idle = last_step_end.map_or(Duration::ZERO, |_| waiting.elapsed());
                if !config.step_delay.is_zero() {
                    std::thread::sleep(config.step_delay);
                }
                let started = Instant::now();
                let collective_before = current.comm.stats().time;
                let span = debug_span!(
                    "step",
                    epoch = plan.epoch,
                    step = plan.step,
                    new = plan.new.len(),
                    prefill = plan.prefill.len(),
                    decode = plan.decode.len()
                );
                let result =
                    span.in_scope(|| current.engine.step(model, &plan, current.comm.as_mut()));
                let done = Instant::now();
                last_step_end = Some(done);
                match result {
                    Ok(out) => {
                        let timings = StepTimings {
                            step_us: micros(done - started),
                            collective_us: micros(current.comm.stats().time - collective_before),
                            idle_us: micros(idle),
                        };
                        let (tokens, cached) = if config.rank == Rank(0) {
                            (out.tokens, out.cached)
                        } else {
                            (Vec::new(), Vec::new())
                        };
                        let _ = events.send(ShardMsg::StepDone(StepDone {
                            epoch: plan.epoch,
                            step: plan.step,
                            tokens,
                            free_blocks: current.engine.free_blocks() as u32,
                            cached,
                            timings,
                        }));
                    }
                    Err(error) => {
                        warn!(epoch = plan.epoch, step = plan.step, %error, "step failed");
                        let error = error.to_wire(config.rank);
                        let _ = events.send(ShardMsg::Failed {
                            epoch: plan.epoch,
                            error,
                        });
                        // A failed step leaves the collective aborted and the sequences
                        // half-advanced: this epoch is over for this rank.
                        active = None;
                    }
                }
            }
        }
    }
}

/// Loads the slice (once), joins the epoch's collective and sizes the KV cache, or
/// carries the last epoch's cache and the sequences the assignment keeps.
fn assign(
    config: &WorkerConfig,
    model: &mut Option<Arc<ModelSlice>>,
    assignment: Assignment,
    carried: Option<Engine>,
    events: &UnboundedSender<ShardMsg>,
) -> Result<(Active, Ready), ShardError> {
    let epoch = assignment.epoch;
    let term = assignment.term;
    let llama = match model {
        Some(m) => Arc::clone(m),
        None => {
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
            let mut on_upload = |done: usize, layers: usize| {
                if done == layers {
                    info!(layers, "uploaded to the device");
                }
            };
            let loaded = Arc::new(ModelSlice::place(
                llama,
                config.device.clone(),
                &mut on_upload,
            )?);
            info!(
                rank = %config.rank,
                weight_bytes = loaded.weight_bytes(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "weights loaded"
            );
            *model = Some(Arc::clone(&loaded));
            loaded
        }
    };
    let collective = CollectiveConfig {
        deadline: Duration::from_millis(assignment.collective_deadline_ms),
        ..CollectiveConfig::default()
    };
    let comm = connect(
        &assignment.bootstrap,
        config.rank,
        config.tp,
        &assignment.token,
        collective,
    )?;
    let (engine, kept) = match carried {
        Some(engine) => engine.carry(epoch, &assignment.keep),
        None => {
            let budget = usize::try_from(config.kv_memory_bytes).unwrap_or(usize::MAX);
            let cache = llama.new_cache(budget)?;
            (Engine::new(config.rank, epoch, cache), Vec::new())
        }
    };
    let blocks = engine.num_blocks();
    info!(epoch, rank = %config.rank, kv_blocks = blocks, carried = kept.len(), "joined the group");
    let ready = Ready {
        epoch,
        kv_blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        block_size: engine.block_size() as u32,
        weight_bytes: llama.weight_bytes() as u64,
        kept,
    };
    Ok((Active { term, comm, engine }, ready))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::TermFence;

    #[test]
    fn assignments_of_an_older_term_are_fenced_off() {
        let mut fence = TermFence::default();
        assert!(fence.admit(3));
        // The same leader re-assigning (a new epoch) is fine.
        assert!(fence.admit(3));
        // A deposed leader of term 2 is not.
        assert!(!fence.admit(2));
        assert!(fence.admit(5));
        assert!(!fence.admit(4));
        assert!(!fence.admit(3));
    }
}
