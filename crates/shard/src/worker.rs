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
use std::sync::mpsc::{Receiver, RecvError, Sender};
use std::time::{Duration, Instant};

use tessera_comm::nccl::{NcclError, NcclGroup};
use tessera_comm::proto::{Assignment, HeldSeq, ShardMsg, StepDone, StepPlan, StepTimings};
use tessera_kernels::cuda::CudaDevice;
use tessera_model::slice::ModelSlice;
use tessera_topology::{Rank, RankPlan};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::{debug, debug_span, warn};

use crate::assign::{Active, Joined, PendingNccl, Stage, assign};
use crate::engine::Engine;
use crate::error::ShardError;

/// What the control task asks of the compute thread.
#[derive(Debug)]
pub enum Command {
    Assign(Assignment),
    Step(StepPlan),
    /// The journaled sequences held now, for a registration (answered after every
    /// command sent before it, so the report is final for the old connection).
    Held(oneshot::Sender<Vec<HeldSeq>>),
    /// The unique id of an NCCL group's epoch, relayed from rank 0.
    NcclId {
        epoch: u64,
        id: Vec<u8>,
    },
    /// An NCCL join (run on a thread of its own) ended.
    Joined {
        epoch: u64,
        group: Result<NcclGroup, NcclError>,
    },
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
/// `joins` sends into `commands`: NCCL joins report there.
pub fn run(
    config: WorkerConfig,
    commands: Receiver<Command>,
    joins: Sender<Command>,
    events: UnboundedSender<ShardMsg>,
) {
    let mut model: Option<Arc<ModelSlice>> = None;
    let mut active: Option<Active> = None;
    // An NCCL assignment not joined yet.
    let mut pending: Option<PendingNccl> = None;
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
                    .or_else(|| pending.take().and_then(|p| p.carried))
                    .filter(|_| !assignment.keep.is_empty());
                last_step_end = None;
                let epoch = assignment.epoch;
                let joined = assign(&config, &mut model, assignment, carried, &events, &joins);
                settle(&config, joined, epoch, &mut active, &mut pending, &events);
            }
            Command::NcclId { epoch, id } => {
                let Some(waiting) = pending
                    .take_if(|p| p.assignment.epoch == epoch && p.stage == Stage::AwaitingId)
                else {
                    debug!(epoch, "an NCCL id for no assignment waiting for one");
                    continue;
                };
                let joined = waiting.join(&config, &id, &joins).map(Joined::Pending);
                settle(&config, joined, epoch, &mut active, &mut pending, &events);
            }
            Command::Joined { epoch, group } => {
                let Some(joining) =
                    pending.take_if(|p| p.assignment.epoch == epoch && p.stage == Stage::Joining)
                else {
                    // A join the group gave up on: dropping it aborts its communicator.
                    debug!(epoch, ok = group.is_ok(), "a stale NCCL join ended");
                    continue;
                };
                let joined = joining.joined(&config, group).map(Joined::Ready);
                settle(&config, joined, epoch, &mut active, &mut pending, &events);
            }
            Command::Held(reply) => {
                let held = active
                    .as_ref()
                    .map(|a| &a.engine)
                    .or_else(|| pending.as_ref().and_then(|p| p.carried.as_ref()))
                    .map(Engine::journaled_held)
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

/// Takes the outcome of an assignment: serving, waiting for the NCCL id, or failed.
fn settle(
    config: &WorkerConfig,
    joined: Result<Joined, ShardError>,
    epoch: u64,
    active: &mut Option<Active>,
    pending: &mut Option<PendingNccl>,
    events: &UnboundedSender<ShardMsg>,
) {
    match joined {
        Ok(Joined::Ready((next, ready))) => {
            *active = Some(next);
            let _ = events.send(ShardMsg::Ready(ready));
        }
        Ok(Joined::Pending(waiting)) => *pending = Some(waiting),
        Err(error) => {
            warn!(epoch, %error, "assignment failed");
            let error = error.to_wire(config.rank);
            let _ = events.send(ShardMsg::Failed { epoch, error });
        }
    }
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
