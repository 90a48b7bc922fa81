//! The compute thread of a shard: owns the model slice, the collective and the
//! [`StepRunner`] of the current epoch. The control task sends it [`Command`]s and relays
//! its [`ShardMsg`]s to the coordinator.
//!
//! - `assign`: taking an assignment: load once, join a host-memory collective, size or
//!   carry the KV cache.
//! - `nccl` (feature `cuda`): joining an NCCL group, in steps (rank 0's unique id travels
//!   through the coordinator; the join runs on a thread of its own).
//!
//! Weights outlive epochs: after a failure the thread drops the collective and the KV
//! cache, keeps the model, and waits for the next `Assign`. Without a failure (the
//! coordinator leader changed), the cache and the sequences an `Assign` names in `keep`
//! carry into the new epoch.

use std::path::PathBuf;
#[cfg(feature = "cuda")]
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvError, Sender};
use std::time::{Duration, Instant};

mod assign;
#[cfg(feature = "cuda")]
mod nccl;

#[cfg(feature = "cuda")]
use tessera_comm::nccl::{NcclError, NcclGroup};
use tessera_comm::proto::{
    Assignment, Bootstrap, Epoch, HeldSeq, Ready, ShardMsg, StepDone, StepPlan, StepTimings, Term,
};
#[cfg(feature = "cuda")]
use tessera_kernels::cuda::CudaDevice;
use tessera_topology::{ModelDtype, Precision, Rank};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::{debug, debug_span, info, warn};

use crate::error::ShardError;
use crate::runner::StepRunner;
use assign::Active;
#[cfg(feature = "cuda")]
use nccl::{PendingNccl, Stage};

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
        epoch: Epoch,
        id: Vec<u8>,
    },
    /// An NCCL join (run on a thread of its own) ended.
    #[cfg(feature = "cuda")]
    Joined {
        epoch: Epoch,
        group: Result<NcclGroup, NcclError>,
    },
}

/// What a shard is, for the whole life of the process.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub rank: Rank,
    pub tp: usize,
    /// How the weights are held once loaded (the topology's `dtype`). Which weights, and
    /// so this rank's slice of them, each assignment says ([`Assignment::model`]).
    pub dtype: ModelDtype,
    /// The group's precision, for every model version it loads.
    pub precision: Precision,
    /// Version 1 of the model: its files as this host's topology names them (a relative
    /// path resolves against this host's topology file, not the coordinator's). Later
    /// versions are loaded from the path their deploy gave.
    pub first_version: PathBuf,
    pub kv_memory_bytes: u64,
    /// The GPU this rank runs on (`None`: the CPU).
    #[cfg(feature = "cuda")]
    pub device: Option<Arc<CudaDevice>>,
    /// Sampling rows ask the pass to sample on the device (see
    /// [`StepRunner::with_device_sampling`]); the CPU gives logits regardless.
    pub device_sampling: bool,
    /// Fault injection for tests: sleep this long before every step (a slow shard).
    pub step_delay: Duration,
    /// Fault injection for tests: every step fails while the model served holds a file of
    /// this name (a model version planted to fail).
    pub step_error_file: Option<String>,
}

/// Term fencing: a shard follows the newest coordinator leader it has heard from. An
/// assignment from an older Raft term comes from a deposed leader and is ignored, so that
/// leader can no longer drive this shard.
#[derive(Debug, Default)]
struct TermFence {
    newest: Term,
}

impl TermFence {
    /// Whether an assignment of `term` may be taken; taking it raises the fence.
    fn admit(&mut self, term: Term) -> bool {
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
    let mut worker = Worker {
        config,
        events,
        joins,
        model: None,
        active: None,
        #[cfg(feature = "cuda")]
        pending: None,
        last_step_end: None,
        fence: TermFence::default(),
    };
    loop {
        let waiting = Instant::now();
        match commands.recv() {
            Ok(command) => worker.handle(command, waiting),
            Err(RecvError) => return,
        }
    }
}

/// What taking an assignment came to.
enum Joined {
    Ready((Active, Ready)),
    #[cfg(feature = "cuda")]
    Pending(PendingNccl),
}

/// The compute thread's state, for the life of the process.
struct Worker {
    config: WorkerConfig,
    events: UnboundedSender<ShardMsg>,
    /// Into the command channel: NCCL joins report there.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    joins: Sender<Command>,
    /// Loaded by the first assignment, kept across epochs that serve the same version.
    model: Option<assign::Loaded>,
    active: Option<Active>,
    /// An NCCL assignment not joined yet.
    #[cfg(feature = "cuda")]
    pending: Option<PendingNccl>,
    last_step_end: Option<Instant>,
    fence: TermFence,
}

impl Worker {
    /// `waiting`: when the thread started waiting for this command (a step's idle time).
    fn handle(&mut self, command: Command, waiting: Instant) {
        match command {
            Command::Assign(assignment) => self.assign(assignment),
            Command::NcclId { epoch, id } => self.nccl_id(epoch, id),
            #[cfg(feature = "cuda")]
            Command::Joined { epoch, group } => self.joined(epoch, group),
            Command::Held(reply) => {
                let _ = reply.send(self.held());
            }
            Command::Step(plan) => self.step(plan, waiting),
        }
    }

    fn assign(&mut self, assignment: Assignment) {
        if !self.fence.admit(assignment.term) {
            warn!(
                term = %assignment.term,
                newest = %self.fence.newest,
                "assignment from a deposed coordinator leader ignored"
            );
            return;
        }
        // The old epoch's collective goes first, and its cache unless sequences carry
        // over: the memory is needed. Another model version drops both, and the weights.
        let same_model = self
            .model
            .as_ref()
            .is_some_and(|m| m.source == assignment.model);
        if !same_model && self.model.take().is_some() {
            info!(version = assignment.model.version, path = %assignment.model.path, "another model version: the weights held are dropped");
        }
        let carried = (self.take_runner()).filter(|_| same_model && !assignment.keep.is_empty());
        self.last_step_end = None;
        let epoch = assignment.epoch;
        let joined = self.take(assignment, carried);
        self.settle(joined, epoch);
    }

    /// Loads (once), then joins the assignment's collective, or waits for the NCCL id
    /// where that is what the group needs first.
    fn take(
        &mut self,
        assignment: Assignment,
        carried: Option<StepRunner>,
    ) -> Result<Joined, ShardError> {
        let slice = assign::load_once(&self.config, &mut self.model, &assignment, &self.events)?;
        if !matches!(assignment.bootstrap, Bootstrap::Nccl) {
            return assign::join_host(&self.config, slice, assignment, carried).map(Joined::Ready);
        }
        #[cfg(feature = "cuda")]
        {
            let (events, joins) = (&self.events, &self.joins);
            nccl::start(&self.config, slice, assignment, carried, events, joins)
                .map(Joined::Pending)
        }
        #[cfg(not(feature = "cuda"))]
        Err(tessera_comm::CollectiveError::Io {
            op: tessera_comm::collective::Op::Connect,
            message: "an NCCL group needs a shard built with the `cuda` feature".into(),
        }
        .into())
    }

    /// The runner of the epoch being left, served or still joining.
    fn take_runner(&mut self) -> Option<StepRunner> {
        let active = self.active.take().map(|a| a.runner);
        #[cfg(feature = "cuda")]
        let active = active.or_else(|| self.pending.take().and_then(|p| p.carried));
        active
    }

    /// The journaled sequences held now (served, or carried into a join).
    fn held(&self) -> Vec<HeldSeq> {
        let runner = self.active.as_ref().map(|a| &a.runner);
        #[cfg(feature = "cuda")]
        let runner = runner.or_else(|| self.pending.as_ref().and_then(|p| p.carried.as_ref()));
        runner.map(StepRunner::journaled_held).unwrap_or_default()
    }

    #[cfg(feature = "cuda")]
    fn nccl_id(&mut self, epoch: Epoch, id: Vec<u8>) {
        let Some(waiting) = self
            .pending
            .take_if(|p| p.assignment.epoch == epoch && p.stage == Stage::AwaitingId)
        else {
            debug!(%epoch, "an NCCL id for no assignment waiting for one");
            return;
        };
        let joined = waiting.join(&self.config, &id, &self.joins);
        self.settle(joined.map(Joined::Pending), epoch);
    }

    #[cfg(not(feature = "cuda"))]
    fn nccl_id(&mut self, epoch: Epoch, _id: Vec<u8>) {
        debug!(%epoch, "an NCCL id, but this shard is built without `cuda`");
    }

    #[cfg(feature = "cuda")]
    fn joined(&mut self, epoch: Epoch, group: Result<NcclGroup, NcclError>) {
        let Some(joining) = self
            .pending
            .take_if(|p| p.assignment.epoch == epoch && p.stage == Stage::Joining)
        else {
            // A join the group gave up on: dropping it aborts its communicator.
            debug!(%epoch, ok = group.is_ok(), "a stale NCCL join ended");
            return;
        };
        let joined = joining.joined(&self.config, group);
        self.settle(joined.map(Joined::Ready), epoch);
    }

    /// Runs a plan of the current term and epoch and reports it, or the failure that
    /// ends this rank's epoch.
    fn step(&mut self, plan: StepPlan, waiting: Instant) {
        let (Some(loaded), Some(current)) = (self.model.as_ref(), self.active.as_mut()) else {
            debug!(
                epoch = %plan.epoch,
                step = %plan.step,
                "plan without an active epoch"
            );
            return;
        };
        if plan.term != current.term || plan.epoch != current.runner.epoch() {
            debug!(
                term = %plan.term,
                epoch = %plan.epoch,
                step = %plan.step,
                "plan of another term or epoch"
            );
            return;
        }
        let idle = self
            .last_step_end
            .map_or(Duration::ZERO, |_| waiting.elapsed());
        if !self.config.step_delay.is_zero() {
            std::thread::sleep(self.config.step_delay);
        }
        let started = Instant::now();
        let collective_before = current.comm.stats();
        let span = debug_span!(
            "step",
            epoch = %plan.epoch,
            step = %plan.step,
            new = plan.new.len(),
            prefill = plan.prefill.len(),
            decode = plan.decode.len()
        );
        let result = span.in_scope(|| {
            if let Some(file) = &loaded.planted_fault {
                return Err(ShardError::PlantedFault { file: file.clone() });
            }
            let mut comm = current.comm.for_step();
            current.runner.step(&loaded.slice, &plan, &mut comm)
        });
        let done = Instant::now();
        self.last_step_end = Some(done);
        let out = match result {
            Ok(out) => out,
            Err(error) => {
                warn!(epoch = %plan.epoch, step = %plan.step, %error, "step failed");
                let error = error.to_wire(self.config.rank);
                let _ = self.events.send(ShardMsg::Failed {
                    epoch: plan.epoch,
                    error,
                });
                // A failed step leaves the collective aborted and the sequences
                // half-advanced: this epoch is over for this rank.
                self.active = None;
                return;
            }
        };
        let collective = current.comm.stats();
        let timings = StepTimings {
            step_us: micros(done - started),
            collective_us: micros(collective.time - collective_before.time),
            idle_us: micros(idle),
            collective_bytes: collective.bytes - collective_before.bytes,
        };
        let (tokens, cached) = if self.config.rank == Rank(0) {
            (out.tokens, out.cached)
        } else {
            (Vec::new(), Vec::new())
        };
        let _ = self.events.send(ShardMsg::StepDone(StepDone {
            epoch: plan.epoch,
            step: plan.step,
            tokens,
            free_blocks: current.runner.free_blocks() as u32,
            cached,
            timings,
        }));
    }

    /// Takes the outcome of an assignment: serving, waiting for the NCCL id, or failed.
    fn settle(&mut self, joined: Result<Joined, ShardError>, epoch: Epoch) {
        match joined {
            Ok(Joined::Ready((next, ready))) => {
                self.active = Some(next);
                let _ = self.events.send(ShardMsg::Ready(ready));
            }
            #[cfg(feature = "cuda")]
            Ok(Joined::Pending(waiting)) => self.pending = Some(waiting),
            Err(error) => {
                warn!(%epoch, %error, "assignment failed");
                let error = error.to_wire(self.config.rank);
                let _ = self.events.send(ShardMsg::Failed { epoch, error });
            }
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::TermFence;
    use tessera_comm::proto::Term;

    #[test]
    fn assignments_of_an_older_term_are_fenced_off() {
        let mut fence = TermFence::default();
        assert!(fence.admit(Term(3)));
        // The same leader re-assigning (a new epoch) is fine.
        assert!(fence.admit(Term(3)));
        // A deposed leader of term 2 is not.
        assert!(!fence.admit(Term(2)));
        assert!(fence.admit(Term(5)));
        assert!(!fence.admit(Term(4)));
        assert!(!fence.admit(Term(3)));
    }
}
