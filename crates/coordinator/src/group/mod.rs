//! Tensor-parallel groups as the coordinator drives them.
//!
//! - [`scheduler`]: the pure core of one group — queue, admission by KV blocks, pipelined
//!   step plans, results.
//! - [`driver`]: one tokio task per group that owns the scheduler and the control streams
//!   of the group's shards; it assigns epochs, sends plans, applies results, enforces the
//!   step deadline and fences the group on any failure.
//! - [`GroupHandle`]: what the rest of the coordinator holds to submit requests to a
//!   group and to attach a newly registered shard.

pub mod driver;
pub mod scheduler;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tessera_comm::proto::{ModelSource, WireError};
use tessera_topology::Rank;
use tokio::sync::{mpsc, oneshot};

use crate::engine::{GenerateRequest, GroupStatus, TokenEvent, TokenStream};
use crate::error::CoordinatorError;

/// The control streams of one registered shard.
#[derive(Debug)]
pub struct ShardLink {
    pub connection: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    pub pid: u32,
    /// As the shard registered it (`cpu`, `cuda:0`).
    pub device: String,
    /// The journaled sequences it still holds from an earlier epoch.
    pub held: Vec<tessera_comm::proto::HeldSeq>,
}

/// What a group's driver publishes for the router and the status API.
#[derive(Debug, Default)]
pub struct Shared {
    ready: AtomicBool,
    /// Set when the group first serves an epoch (its ranks warmed up before), for good.
    warmed: AtomicBool,
    /// Out of routing: the replicated state's `GroupRecord::drained`, as the leader saw it
    /// last.
    drained: AtomicBool,
    /// Out of routing while the leader moves it to another model version.
    switching: AtomicBool,
    /// The model version of the epoch served last (0 before the first).
    version: AtomicU32,
    /// The model version the group was started with or last asked to serve.
    asked: Mutex<ModelSource>,
    waiting: AtomicUsize,
    max_waiting: usize,
    status: Mutex<GroupStatus>,
}

/// What a group's driver is asked to do.
#[derive(Debug)]
pub enum GroupCommand {
    /// A shard of this group registered (replacing any earlier connection of its rank).
    Attach { rank: Rank, link: ShardLink },
    /// Queue a sequence; `reply` says whether it was queued, `events` carries its tokens.
    /// `id` is its journal id; `generated`, tokens it produced before (a resumed request).
    Submit {
        id: String,
        request: GenerateRequest,
        generated: Vec<u32>,
        events: TokenSender,
        reply: oneshot::Sender<Result<(), WireError>>,
    },
    /// Serve this model version from the next epoch on (ending the current one).
    Serve { source: ModelSource },
    /// The group leaves the cluster: its shards are asked to exit, and the driver ends
    /// (what still runs fails).
    Stop,
}

/// Where a sequence's tokens go.
pub type TokenSender = mpsc::UnboundedSender<Result<TokenEvent, WireError>>;

/// A cloneable handle on a group's driver.
#[derive(Clone, Debug)]
pub struct GroupHandle {
    pub name: String,
    pub model: String,
    pub tp: usize,
    commands: mpsc::Sender<GroupCommand>,
    shared: Arc<Shared>,
}

/// Requests a group's driver buffers before `submit` waits: generous, since each is
/// handled in microseconds; the scheduler's queue is where requests wait.
const COMMAND_BUFFER: usize = 1024;

impl GroupHandle {
    /// True while the group is serving an epoch.
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Relaxed)
    }

    /// True once the group has served an epoch, so its ranks have warmed up (a group
    /// fenced later stays warmed).
    pub fn has_warmed(&self) -> bool {
        self.shared.warmed.load(Ordering::Relaxed)
    }

    /// True while the group is drained: routing sends it no new request.
    pub fn is_drained(&self) -> bool {
        self.shared.drained.load(Ordering::Relaxed)
    }

    /// Takes the group out of routing, or back in.
    pub fn set_drained(&self, drained: bool) {
        self.shared.drained.store(drained, Ordering::Relaxed);
    }

    /// True while the leader moves the group to another model version: routing sends
    /// it no new request.
    pub fn is_switching(&self) -> bool {
        self.shared.switching.load(Ordering::Relaxed)
    }

    pub fn set_switching(&self, switching: bool) {
        self.shared.switching.store(switching, Ordering::Relaxed);
    }

    /// The model version of the epoch it served last (0 before its first).
    pub fn version(&self) -> u32 {
        self.shared.version.load(Ordering::Relaxed)
    }

    /// The model version it was started with or last asked to serve (which it may not
    /// serve yet).
    pub fn asked(&self) -> ModelSource {
        (self
            .shared
            .asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner))
        .clone()
    }

    /// Serves model version `source` from its next epoch on; the current epoch ends
    /// (drain the group first: what still runs in it fails).
    pub async fn serve(&self, source: ModelSource) -> Result<(), WireError> {
        *self
            .shared
            .asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = source.clone();
        self.commands
            .send(GroupCommand::Serve { source })
            .await
            .map_err(|_| self.stopped())
    }

    /// Waits until the group runs and queues nothing, for up to `within`; whether it
    /// became idle.
    pub async fn until_idle(&self, within: std::time::Duration) -> bool {
        let until = std::time::Instant::now() + within;
        loop {
            let s = self.status();
            if s.running == 0 && s.waiting == 0 {
                return true;
            }
            if std::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Asks the driver to stop: see [`GroupCommand::Stop`]. Returns once it was told.
    pub async fn stop(&self) {
        // A driver already gone has nothing to stop.
        let _ = self.commands.send(GroupCommand::Stop).await;
    }

    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.shared.waiting.load(Ordering::Relaxed)
    }

    /// True when the waiting queue cannot take another request.
    pub fn queue_full(&self) -> bool {
        self.waiting() >= self.shared.max_waiting
    }

    /// The group's live status (as of the driver's last event).
    pub fn status(&self) -> GroupStatus {
        let mut status = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        status.drained = self.is_drained();
        status.switching = self.is_switching();
        status.version = self.version();
        status
    }

    pub async fn attach(&self, rank: Rank, link: ShardLink) -> Result<(), WireError> {
        self.commands
            .send(GroupCommand::Attach { rank, link })
            .await
            .map_err(|_| self.stopped())
    }

    /// Queues `request` (journal id `id`) on this group, to go on after the `generated`
    /// tokens it produced before; its next tokens arrive on the returned stream.
    pub async fn generate(
        &self,
        id: String,
        request: GenerateRequest,
        generated: Vec<u32>,
    ) -> Result<TokenStream, WireError> {
        let (reply, answer) = oneshot::channel();
        let (events, stream) = mpsc::unbounded_channel();
        self.commands
            .send(GroupCommand::Submit {
                id,
                request,
                generated,
                events,
                reply,
            })
            .await
            .map_err(|_| self.stopped())?;
        answer.await.map_err(|_| self.stopped())??;
        Ok(TokenStream::new(stream).versioned(Some(self.version()).filter(|&v| v > 0)))
    }

    fn stopped(&self) -> WireError {
        let group = self.name.clone();
        CoordinatorError::GroupStopped { group }.into()
    }
}
