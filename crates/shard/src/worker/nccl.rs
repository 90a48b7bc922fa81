//! Joining an NCCL group (feature `cuda`), which takes steps of its own.
//!
//! Rank 0 makes the communicator's unique id, sends it to the coordinator
//! ([`ShardMsg::NcclId`]) and joins; every other rank loads, then waits until the
//! coordinator relays the id, and joins with it. NCCL's join blocks until every rank has
//! joined and has no timeout, so it runs on a thread of its own that reports through the
//! worker's command channel ([`Command::Joined`]): the compute thread stays free to take a
//! newer assignment if the group fails meanwhile (the stale join's result is then dropped,
//! which aborts its communicator).

use std::sync::Arc;
use std::sync::mpsc::Sender;

use tessera_comm::collective::{CollectiveError, Op};
use tessera_comm::nccl::{ID_BYTES, NcclError, NcclGroup, unique_id};
use tessera_comm::proto::{Assignment, Ready, ShardMsg};
use tessera_model::slice::ModelSlice;
use tessera_topology::Rank;
use tokio::sync::mpsc::UnboundedSender;

use super::assign::{Active, GroupComm, collective_config, finish};
use super::{Command, WorkerConfig};
use crate::error::ShardError;
use crate::runner::StepRunner;

/// Where an NCCL assignment stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Rank > 0: waiting for rank 0's id.
    AwaitingId,
    /// The join runs on its own thread.
    Joining,
}

/// An NCCL assignment, loaded, not joined yet.
pub(super) struct PendingNccl {
    pub(super) assignment: Assignment,
    pub(super) carried: Option<StepRunner>,
    pub(super) stage: Stage,
    model: Arc<ModelSlice>,
}

/// Starts taking an NCCL assignment: rank 0 makes the id, sends it and starts joining;
/// the other ranks wait for the id.
pub(super) fn start(
    config: &WorkerConfig,
    model: Arc<ModelSlice>,
    assignment: Assignment,
    carried: Option<StepRunner>,
    events: &UnboundedSender<ShardMsg>,
    joins: &Sender<Command>,
) -> Result<PendingNccl, ShardError> {
    let pending = PendingNccl {
        assignment,
        carried,
        stage: Stage::AwaitingId,
        model,
    };
    if config.rank != Rank(0) {
        return Ok(pending);
    }
    let id = unique_id().map_err(|e| e.in_op(Op::Connect))?;
    let _ = events.send(ShardMsg::NcclId {
        epoch: pending.assignment.epoch,
        id: id.to_vec(),
    });
    pending.join(config, &id, joins)
}

impl PendingNccl {
    /// Starts joining the group with `id` (rank 0's) on a thread of its own; its result
    /// comes back as [`Command::Joined`].
    pub(super) fn join(
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
    pub(super) fn joined(
        self,
        config: &WorkerConfig,
        group: Result<NcclGroup, NcclError>,
    ) -> Result<(Active, Ready), ShardError> {
        let group = group.map_err(|e| e.in_op(Op::Connect))?;
        let comm = GroupComm::Nccl(Box::new(group));
        finish(config, self.model, self.assignment, self.carried, comm)
    }
}
