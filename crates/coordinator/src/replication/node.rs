//! The driver of one [`Peer`]: a thread of its own (its store fsyncs, which must not
//! block the async runtime) that ticks the peer every [`TICK`], feeds it the messages and
//! proposals that arrive, and after each hands the messages it produced to a
//! [`Transport`]. Callers hold a [`NodeHandle`]: they propose commands and wait for them
//! to be applied, watch the peer's role, the members and groups and the journal's usage,
//! and read the replicated state.
//!
//! The peer fails stop: when its store fails, or the thread panics, the driver stops and
//! [`NodeHandle::failure`] says why, so that the process can exit and be restarted from
//! what its store holds, rather than live on without a working Raft peer.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use raft::prelude::{Message, MessageType};
use tessera_topology::PeerId;
use tokio::sync::{oneshot, watch};
use tracing::{error, info};

use super::peer::{Applied, MembershipChange, Peer, ProposalId, ProposalRefused, Role, TICK};
use super::state::{ClusterState, Command, JournalUsage, Summary};

/// Where a peer's messages go. Sending never blocks: a transport queues, and reports a
/// message it could not deliver through [`NodeHandle::unreachable`].
pub trait Transport: Send + 'static {
    fn send(&mut self, message: Message);
}

/// Why a proposal did not complete: the Raft core refused it ([`ProposalRefused`]), it
/// was not applied in time, or the peer stopped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProposalError {
    #[error(transparent)]
    Refused(#[from] ProposalRefused),
    /// It may still be applied later: its outcome is unknown.
    #[error("the proposal was not applied within {0:?} (a leader change may have lost it)")]
    Timeout(Duration),
    #[error("the raft peer has stopped")]
    Stopped,
}

/// The most inputs handled before the peer's Ready is processed.
const BATCH_INPUTS: usize = 1024;

enum Input {
    Raft(Message),
    Propose(Proposal, oneshot::Sender<Result<Applied, ProposalError>>),
    Unreachable { to: PeerId, snapshot: bool },
    SnapshotSent { to: PeerId },
    Read(Read),
    HandOver(oneshot::Sender<Option<PeerId>>),
    Stop,
}

/// A reader of the replicated state, run on the driver's thread.
type Read = Box<dyn FnOnce(&ClusterState) + Send>;

enum Proposal {
    Command(Command),
    Membership(MembershipChange),
}

/// A running peer.
#[derive(Clone)]
pub struct NodeHandle {
    inputs: mpsc::Sender<Input>,
    role: watch::Receiver<Role>,
    summary: watch::Receiver<Arc<Summary>>,
    voters: watch::Receiver<Vec<PeerId>>,
    journal: watch::Receiver<JournalUsage>,
    failure: watch::Receiver<Option<String>>,
    thread: Arc<std::sync::Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for NodeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeHandle")
            .field("role", &*self.role.borrow())
            .finish_non_exhaustive()
    }
}

impl NodeHandle {
    /// A message from another peer.
    pub fn receive(&self, message: Message) {
        let _ = self.inputs.send(Input::Raft(message));
    }

    /// A message to `to` was not delivered.
    pub fn unreachable(&self, to: PeerId, was_snapshot: bool) {
        let _ = self.inputs.send(Input::Unreachable {
            to,
            snapshot: was_snapshot,
        });
    }

    /// A snapshot message reached `to`.
    pub fn snapshot_sent(&self, to: PeerId) {
        let _ = self.inputs.send(Input::SnapshotSent { to });
    }

    /// Proposes `command` and waits until this peer has applied it, for `timeout` at most.
    pub async fn propose(
        &self,
        command: Command,
        timeout: Duration,
    ) -> Result<Applied, ProposalError> {
        self.submit(Proposal::Command(command), timeout).await
    }

    /// Proposes a membership change and waits until it is applied here.
    pub async fn change_membership(
        &self,
        change: MembershipChange,
        timeout: Duration,
    ) -> Result<Applied, ProposalError> {
        self.submit(Proposal::Membership(change), timeout).await
    }

    async fn submit(
        &self,
        proposal: Proposal,
        timeout: Duration,
    ) -> Result<Applied, ProposalError> {
        let (tx, rx) = oneshot::channel();
        let proposed = Instant::now();
        self.inputs
            .send(Input::Propose(proposal, tx))
            .map_err(|_| ProposalError::Stopped)?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(result)) => {
                if result.is_ok() {
                    ::metrics::histogram!(crate::metrics::RAFT_PROPOSAL_SECONDS)
                        .record(proposed.elapsed().as_secs_f64());
                }
                result
            }
            Ok(Err(_)) => Err(ProposalError::Stopped),
            Err(_) => Err(ProposalError::Timeout(timeout)),
        }
    }

    /// The peer's role and term, updated as they change.
    pub fn role(&self) -> watch::Receiver<Role> {
        self.role.clone()
    }

    /// The voters of the configuration this peer applied last.
    pub fn voters(&self) -> Vec<PeerId> {
        self.voters.borrow().clone()
    }

    /// Members and groups of the replicated state, updated when they change.
    pub fn summary(&self) -> watch::Receiver<Arc<Summary>> {
        self.summary.clone()
    }

    /// What the request journal holds, as this peer last applied it.
    pub fn journal_usage(&self) -> JournalUsage {
        *self.journal.borrow()
    }

    /// [`NodeHandle::journal_usage`], updated as it changes.
    pub fn journal(&self) -> watch::Receiver<JournalUsage> {
        self.journal.clone()
    }

    /// Why the peer stopped on its own (its store failed, its thread panicked), once it
    /// has; `None` while it runs, and after [`NodeHandle::stop`].
    pub fn failure(&self) -> watch::Receiver<Option<String>> {
        self.failure.clone()
    }

    /// Runs `f` on the replicated state as this peer has applied it (after every
    /// proposal this peer has seen applied); `None` when the peer has stopped. The state
    /// is not copied: the journal it holds may be large.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ClusterState) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        let read: Read = Box::new(move |state| {
            let _ = tx.send(f(state));
        });
        self.inputs.send(Input::Read(read)).ok()?;
        rx.await.ok()
    }

    /// Hands leadership to the most up-to-date other voter ([`Peer::hand_over`]); says to
    /// whom, or `None` when this peer does not lead (or has stopped). The new leader is
    /// known once [`NodeHandle::role`] names it.
    pub async fn hand_over(&self) -> Option<PeerId> {
        let (tx, rx) = oneshot::channel();
        self.inputs.send(Input::HandOver(tx)).ok()?;
        rx.await.ok().flatten()
    }

    /// Stops the peer and waits for its thread (what a crash or a shutdown leaves: the
    /// store holds everything it acknowledged).
    pub fn stop(&self) {
        let _ = self.inputs.send(Input::Stop);
        let thread = self.thread.lock().expect("thread lock").take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// Starts driving `peer`, sending its messages through `transport`.
pub fn spawn(peer: Peer, transport: impl Transport) -> std::io::Result<NodeHandle> {
    let (inputs, rx) = mpsc::channel();
    let (role_tx, role) = watch::channel(peer.role());
    let (summary_tx, summary) = watch::channel(Arc::new(peer.state().summary()));
    let (voters_tx, voters) = watch::channel(peer.voters());
    let (journal_tx, journal) = watch::channel(peer.state().journal_usage());
    let (failure_tx, failure) = watch::channel(None);
    let name = format!("raft-{}", peer.id());
    let thread = std::thread::Builder::new().name(name).spawn(move || {
        let driver = Driver {
            peer,
            transport,
            waiting: HashMap::new(),
            role: role_tx,
            summary: summary_tx,
            voters: voters_tx,
            journal: journal_tx,
        };
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.run(&rx)));
        let stopped = match run {
            Ok(Ok(())) => return,
            Ok(Err(reason)) => reason,
            Err(_) => "its thread panicked".to_string(),
        };
        failure_tx.send_replace(Some(stopped));
    })?;
    Ok(NodeHandle {
        inputs,
        role,
        summary,
        voters,
        journal,
        failure,
        thread: Arc::new(std::sync::Mutex::new(Some(thread))),
    })
}

struct Driver<T> {
    peer: Peer,
    transport: T,
    waiting: HashMap<ProposalId, oneshot::Sender<Result<Applied, ProposalError>>>,
    role: watch::Sender<Role>,
    summary: watch::Sender<Arc<Summary>>,
    voters: watch::Sender<Vec<PeerId>>,
    journal: watch::Sender<JournalUsage>,
}

impl<T: Transport> Driver<T> {
    /// Runs until stopped (`Ok`), or until the store fails: `Err` says how.
    fn run(mut self, inputs: &mpsc::Receiver<Input>) -> Result<(), String> {
        let mut next_tick = Instant::now() + TICK;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match inputs.recv_timeout(wait) {
                Ok(Input::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                Ok(input) => {
                    self.handle(input);
                    // What else is queued joins the same Ready: one write and one fsync
                    // for all of it (group commit).
                    for _ in 1..BATCH_INPUTS {
                        match inputs.try_recv() {
                            Ok(Input::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                                return Ok(());
                            }
                            Ok(input) => self.handle(input),
                            Err(mpsc::TryRecvError::Empty) => break,
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            // Ticks follow the clock, however busy the inputs keep this thread.
            let now = Instant::now();
            if now >= next_tick {
                self.peer.tick();
                next_tick = (next_tick + TICK).max(now);
            }
            if let Err(e) = self.advance() {
                // The store failed: stop taking part rather than act on a state that may
                // not be on disk. A restart recovers from what is.
                error!(peer = self.peer.id().0, error = %e, "raft peer stopped");
                return Err(e.to_string());
            }
        }
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Raft(message) => {
                let _ = self.peer.step(message);
            }
            Input::Propose(proposal, reply) => {
                let proposed = match &proposal {
                    Proposal::Command(command) => self.peer.propose(command),
                    Proposal::Membership(change) => self.peer.propose_membership(change),
                };
                match proposed {
                    Ok(id) => {
                        self.waiting.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                    }
                }
            }
            Input::Unreachable { to, snapshot } => {
                self.peer.report_unreachable(to);
                if snapshot {
                    self.peer.report_snapshot(to, false);
                }
            }
            Input::SnapshotSent { to } => self.peer.report_snapshot(to, true),
            Input::Read(read) => read(self.peer.state()),
            Input::HandOver(reply) => {
                let _ = reply.send(self.peer.hand_over());
            }
            Input::Stop => {}
        }
    }

    fn advance(&mut self) -> Result<(), super::peer::PeerError> {
        let transport = &mut self.transport;
        let out = self.peer.advance_sending(&mut |early| {
            for message in early {
                transport.send(message);
            }
        })?;
        for message in out.messages {
            self.transport.send(message);
        }
        // The watches first: a proposer that wakes up sees the state it waited for.
        if out.restored || !out.applied.is_empty() {
            let summary = self.peer.state().summary();
            self.summary.send_if_modified(|s| {
                let changed = **s != summary;
                if changed {
                    *s = Arc::new(summary);
                }
                changed
            });
            let voters = self.peer.voters();
            self.voters.send_if_modified(|v| {
                let changed = *v != voters;
                *v = voters;
                changed
            });
            let usage = self.peer.state().journal_usage();
            self.journal.send_if_modified(|u| {
                let changed = *u != usage;
                *u = usage;
                changed
            });
        }
        for applied in out.applied {
            if let Some(id) = applied.proposal
                && let Some(reply) = self.waiting.remove(&id)
            {
                let _ = reply.send(Ok(applied));
            }
        }
        // Callers that gave up: forget them.
        self.waiting.retain(|_, reply| !reply.is_closed());
        let role = self.peer.role();
        let before = *self.role.borrow();
        if (role.leader, role.term, role.state) != (before.leader, before.term, before.state) {
            if role.leader != before.leader || role.term != before.term {
                info!(
                    peer = role.id.0,
                    term = %role.term,
                    leader = role.leader.map(|l| l.0),
                    role = ?role.state,
                    "raft leadership"
                );
            }
            self.role.send_replace(role);
        }
        Ok(())
    }
}

/// Whether a message carries a snapshot (its delivery must be reported).
pub fn is_snapshot(message: &Message) -> bool {
    message.get_msg_type() == MessageType::MsgSnapshot
}

#[cfg(test)]
mod tests;
