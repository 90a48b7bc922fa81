//! One coordinator peer's Raft state machine, synchronous and deterministic: a raft-rs
//! `RawNode` over the peer's [`LogStore`], and the [`ClusterState`] its committed entries
//! build. It never sleeps, spawns or reads a clock: its driver calls [`Peer::tick`] every
//! [`TICK`], hands it the messages that arrive ([`Peer::step`]) and the commands to propose
//! ([`Peer::propose`]), and after each of these calls [`Peer::advance`], which persists
//! what Raft needs durable (fsync) *before* it returns the messages that depend on it,
//! applies committed entries and says which of them this peer proposed.
//!
//! The same core runs under the tokio driver ([`super::node`]) and under the tests'
//! deterministic simulation with a simulated network.

use std::time::Duration;

use protobuf::Message as _;
use raft::prelude::{ConfChange, ConfChangeType, ConfState, Entry, EntryType, Message, Snapshot};
use raft::{Config, RawNode, StateRole, Storage};
use serde::{Deserialize, Serialize};
use tessera_comm::proto::Term;
use tessera_comm::wire;
use tessera_topology::PeerId;

use super::state::{ClusterState, Command, Outcome};
use super::store::{LogStore, StoreError};

/// How often the driver ticks the peer.
pub const TICK: Duration = Duration::from_millis(100);
/// Ticks without a leader's heartbeat before a follower campaigns (randomized up to
/// twice as many), and without a quorum's answer before a leader steps down.
pub const ELECTION_TICKS: usize = 10;
/// Ticks between a leader's heartbeats.
pub const HEARTBEAT_TICKS: usize = 1;
/// Applied entries kept in the log before it is compacted into a snapshot (at least: see
/// [`Peer::compact_if_due`]).
pub const DEFAULT_SNAPSHOT_EVERY: u64 = 1_000;
/// The largest command a peer proposes or decodes from a committed entry: with a batch
/// of `max_size_per_msg` (1 MiB) before it, a Raft message still fits one wire frame.
pub const MAX_COMMAND_BYTES: usize = 4 << 20;

/// Why a peer stopped: its store failed, or Raft refused to start. Either way it must be
/// restarted (from its store) rather than go on with a state it cannot trust.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("the replicated state does not decode: {0}")]
    State(#[from] tessera_comm::CommError),
    /// A failpoint fired (feature `failpoints`, tests only): the peer stops there, as if
    /// its process had died at that point.
    #[error("failpoint {0} fired")]
    Injected(&'static str),
}

/// The failpoints of [`Peer::advance`], in the order it passes them. With the feature
/// `failpoints`, `fail::cfg(name, "…return")` makes the peer stop at one (an error, as
/// if its process had died there); without it they cost nothing.
pub const FAILPOINTS: [&str; 5] = [
    "raft::before_send",
    "raft::before_apply",
    "raft::before_persist",
    "raft::after_persist",
    "raft::after_apply",
];

fn failpoint(name: &'static str) -> Result<(), PeerError> {
    // Without the feature the macro expands to nothing.
    let _ = name;
    fail::fail_point!(name, |_| Err(PeerError::Injected(name)));
    Ok(())
}

/// Why this peer's Raft core refused a proposal on the spot. It was not, and never will
/// be, applied. (A proposal taken here may still fail to complete: see
/// [`super::node::ProposalError`].)
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProposalRefused {
    #[error("no leader is known (an election is under way)")]
    NoLeader,
    #[error("the command is {bytes} bytes; the limit is {MAX_COMMAND_BYTES}")]
    TooLarge { bytes: usize },
    #[error("the proposal was dropped: {0}")]
    Dropped(String),
}

/// Who proposed an entry, to tell the proposer when it is applied: the proposing peer, its
/// incarnation (a fresh number each time it starts, so that numbers from before a restart
/// never match) and a sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProposalId {
    pub peer: PeerId,
    pub incarnation: u64,
    pub seq: u64,
}

/// A membership change: `Join` adds a voter with its addresses, `Leave` removes one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    Join {
        id: PeerId,
        http: String,
        quic: String,
    },
    Leave {
        id: PeerId,
    },
}

/// A committed entry as this peer applied it.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    pub index: u64,
    pub term: u64,
    /// Set when this incarnation of this peer proposed it.
    pub proposal: Option<ProposalId>,
    pub command: Command,
    pub outcome: Outcome,
}

/// What one [`Peer::advance`] produced.
#[derive(Debug, Default)]
pub struct Advanced {
    /// Raft messages to send, each to its `to` peer; everything they promise is on disk.
    pub messages: Vec<Message>,
    /// Entries applied, in log order.
    pub applied: Vec<Applied>,
    /// Set when a snapshot from the leader replaced the whole state.
    pub restored: bool,
}

/// The peer's role and term, as `GET /v1/cluster` shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Role {
    pub id: PeerId,
    pub term: Term,
    /// `None` while no leader is known.
    pub leader: Option<PeerId>,
    pub state: StateRole,
}

impl Role {
    pub fn is_leader(&self) -> bool {
        self.state == StateRole::Leader
    }
}

/// One peer: Raft, its store and the replicated state.
pub struct Peer {
    node: RawNode<LogStore>,
    state: ClusterState,
    incarnation: u64,
    next_seq: u64,
    snapshot_every: u64,
    /// A membership change was applied since the last compaction.
    reconfigured: bool,
    /// Bytes of the entries applied since the last compaction (or the start).
    log_bytes: u64,
    /// Bytes of the last snapshot.
    snapshot_bytes: u64,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("role", &self.role())
            .field("applied", &self.state.applied)
            .finish_non_exhaustive()
    }
}

impl Peer {
    /// Starts peer `id` from `store`. A store that has never held a configuration is
    /// bootstrapped with `voters` (the topology's peers; the same on each of them); a
    /// peer joining a running cluster passes no voters and learns the configuration from
    /// the leader. The state is the store's snapshot; the entries after it are applied
    /// again as Raft hands them out.
    pub fn start(
        id: PeerId,
        voters: &[PeerId],
        store: LogStore,
        incarnation: u64,
        logger: &slog::Logger,
    ) -> Result<Peer, PeerError> {
        let initial = store.initial_state()?;
        if initial.conf_state.voters.is_empty() && !voters.is_empty() {
            // Bootstrap: a snapshot at index 1 holding the configuration, the same on
            // every founding peer. A peer that joins later starts empty and receives it
            // (or a later one) from the leader, the configuration with it.
            let mut snapshot = Snapshot::default();
            let meta = snapshot.mut_metadata();
            meta.index = 1;
            meta.term = 1;
            let voters: Vec<u64> = voters.iter().map(|v| v.0).collect();
            meta.set_conf_state(ConfState::from((voters, vec![])));
            store.apply_snapshot(&snapshot)?;
        }
        let snapshot = store.snapshot(0, id.0)?;
        let state = if snapshot.get_data().is_empty() {
            ClusterState::default()
        } else {
            ClusterState::restore(snapshot.get_data())?
        };
        let config = Config {
            id: id.0,
            election_tick: ELECTION_TICKS,
            heartbeat_tick: HEARTBEAT_TICKS,
            applied: snapshot.get_metadata().index,
            pre_vote: true,
            check_quorum: true,
            max_size_per_msg: 1024 * 1024,
            max_inflight_msgs: 256,
            ..Config::default()
        };
        config.validate()?;
        let mut node = RawNode::new(&config, store, logger)?;
        // The only voter needs no election timeout: it leads at once.
        if node.raft.prs().conf().voters().ids().iter().eq([id.0]) {
            node.campaign()?;
        }
        Ok(Peer {
            node,
            state,
            incarnation,
            next_seq: 0,
            snapshot_every: DEFAULT_SNAPSHOT_EVERY,
            reconfigured: false,
            log_bytes: 0,
            snapshot_bytes: snapshot.get_data().len() as u64,
        })
    }

    /// Compacts the log every `entries` applied entries instead of the default.
    pub fn with_snapshot_every(mut self, entries: u64) -> Peer {
        self.snapshot_every = entries.max(1);
        self
    }

    pub fn id(&self) -> PeerId {
        PeerId(self.node.raft.id)
    }

    pub fn role(&self) -> Role {
        Role {
            id: self.id(),
            term: Term(self.node.raft.term),
            // raft-rs says 0 for none: ids start at 1.
            leader: Some(self.node.raft.leader_id)
                .filter(|&l| l != 0)
                .map(PeerId),
            state: self.node.raft.state,
        }
    }

    /// The replicated state as of the last applied entry.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The voters of the last applied configuration.
    pub fn voters(&self) -> Vec<PeerId> {
        let mut voters: Vec<PeerId> = self
            .node
            .store()
            .initial_state()
            .map(|s| s.conf_state.voters.into_iter().map(PeerId).collect())
            .unwrap_or_default();
        voters.sort_unstable();
        voters
    }

    /// One tick of the logical clock ([`TICK`]).
    pub fn tick(&mut self) {
        self.node.tick();
    }

    /// A message from another peer. Messages from unknown or stale peers are Raft's to
    /// ignore; an error here is a message Raft refuses, which changes nothing.
    pub fn step(&mut self, message: Message) -> Result<(), raft::Error> {
        self.node.step(message)
    }

    /// Tells Raft a message to `to` could not be sent (the peer is down or cut off); it
    /// probes that peer again instead of streaming to it.
    pub fn report_unreachable(&mut self, to: PeerId) {
        self.node.report_unreachable(to.0);
    }

    /// Hands leadership to the voter whose log matches the leader's furthest (it can
    /// take over without catching up), before this peer stops. Raft sends it a
    /// `TimeoutNow` once its log is current, and it wins the election that follows; this
    /// peer stops accepting proposals meanwhile. `None` when this peer does not lead or
    /// is the only voter.
    pub fn hand_over(&mut self) -> Option<PeerId> {
        if self.node.raft.state != StateRole::Leader {
            return None;
        }
        let me = self.node.raft.id;
        let to = self
            .voters()
            .into_iter()
            .filter(|v| v.0 != me)
            .filter_map(|v| Some((self.node.raft.prs().get(v.0)?.matched, v)))
            .max_by_key(|&(matched, v)| (matched, std::cmp::Reverse(v)))
            .map(|(_, v)| v)?;
        self.node.transfer_leader(to.0);
        Some(to)
    }

    /// Tells Raft whether a snapshot message reached `to`. Until it hears, the leader
    /// sends that peer nothing else; a lost snapshot is sent again.
    pub fn report_snapshot(&mut self, to: PeerId, delivered: bool) {
        let status = if delivered {
            raft::SnapshotStatus::Finish
        } else {
            raft::SnapshotStatus::Failure
        };
        self.node.report_snapshot(to.0, status);
    }

    /// Proposes `command`. It is applied (on every peer, in log order) once committed;
    /// [`Advanced::applied`] names it with the returned id on this peer. A follower
    /// forwards the proposal to its leader; a leader change can still drop it silently,
    /// so a caller waits with a deadline.
    pub fn propose(&mut self, command: &Command) -> Result<ProposalId, ProposalRefused> {
        let data = wire::encode(command).map_err(|e| ProposalRefused::Dropped(e.to_string()))?;
        if data.len() > MAX_COMMAND_BYTES {
            return Err(ProposalRefused::TooLarge { bytes: data.len() });
        }
        let id = self.next_proposal();
        let context = wire::encode(&id).map_err(|e| ProposalRefused::Dropped(e.to_string()))?;
        self.node
            .propose(context, data)
            .map_err(|e| self.refusal(e))?;
        Ok(id)
    }

    /// Proposes a membership change (one voter at a time).
    pub fn propose_membership(
        &mut self,
        change: &MembershipChange,
    ) -> Result<ProposalId, ProposalRefused> {
        let (node_id, change_type) = match change {
            MembershipChange::Join { id, .. } => (*id, ConfChangeType::AddNode),
            MembershipChange::Leave { id } => (*id, ConfChangeType::RemoveNode),
        };
        let id = self.next_proposal();
        let context = wire::encode(&(id, change.clone()))
            .map_err(|e| ProposalRefused::Dropped(e.to_string()))?;
        let mut cc = ConfChange::default();
        cc.set_change_type(change_type);
        cc.node_id = node_id.0;
        cc.set_context(context.into());
        self.node
            .propose_conf_change(Vec::new(), cc)
            .map_err(|e| self.refusal(e))?;
        Ok(id)
    }

    fn next_proposal(&mut self) -> ProposalId {
        self.next_seq += 1;
        ProposalId {
            peer: self.id(),
            incarnation: self.incarnation,
            seq: self.next_seq,
        }
    }

    fn refusal(&self, error: raft::Error) -> ProposalRefused {
        match error {
            raft::Error::ProposalDropped if self.node.raft.leader_id == 0 => {
                ProposalRefused::NoLeader
            }
            other => ProposalRefused::Dropped(other.to_string()),
        }
    }

    /// Hands out what Raft has ready: persists new entries and the hard state (one durable
    /// transaction), installs a leader's snapshot, applies committed entries, and returns
    /// the messages to send. Call it after every tick, step and proposal.
    pub fn advance(&mut self) -> Result<Advanced, PeerError> {
        let mut early = Vec::new();
        let mut out = self.advance_sending(&mut |m| early.extend(m))?;
        early.append(&mut out.messages);
        out.messages = early;
        Ok(out)
    }

    /// [`Peer::advance`], handing the messages that may leave before this peer's write
    /// (a leader's appends and heartbeats, Raft §10.2.1: they promise nothing about this
    /// peer's disk) to `send` first, so the followers' writes overlap the leader's.
    pub fn advance_sending(
        &mut self,
        send: &mut dyn FnMut(Vec<Message>),
    ) -> Result<Advanced, PeerError> {
        let mut out = Advanced::default();
        if !self.node.has_ready() {
            return Ok(out);
        }
        let mut ready = self.node.ready();
        let early = ready.take_messages();
        failpoint("raft::before_send")?;
        if !early.is_empty() {
            send(early);
        }
        if !ready.snapshot().is_empty() {
            self.install(ready.snapshot())?;
            out.restored = true;
        }
        failpoint("raft::before_apply")?;
        self.apply(ready.take_committed_entries(), &mut out)?;
        failpoint("raft::before_persist")?;
        self.node.store().persist(ready.entries(), ready.hs())?;
        failpoint("raft::after_persist")?;
        // Votes and acknowledgements: only now that what they promise is durable.
        out.messages.extend(ready.take_persisted_messages());
        let mut light = self.node.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.node.store().set_commit(commit);
        }
        out.messages.extend(light.take_messages());
        self.apply(light.take_committed_entries(), &mut out)?;
        failpoint("raft::after_apply")?;
        self.node.advance_apply();
        self.compact_if_due()?;
        Ok(out)
    }

    fn install(&mut self, snapshot: &Snapshot) -> Result<(), PeerError> {
        let state = ClusterState::restore(snapshot.get_data())?;
        self.node.store().apply_snapshot(snapshot)?;
        self.state = state;
        self.snapshot_bytes = snapshot.get_data().len() as u64;
        self.log_bytes = 0;
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>, out: &mut Advanced) -> Result<(), PeerError> {
        for entry in entries {
            if entry.index <= self.state.applied {
                continue;
            }
            self.log_bytes += entry.data.len() as u64;
            let applied = match entry.get_entry_type() {
                EntryType::EntryNormal if entry.data.is_empty() => {
                    // A new leader's empty entry.
                    self.state.applied = entry.index;
                    continue;
                }
                EntryType::EntryNormal => self.apply_command(&entry),
                EntryType::EntryConfChange => self.apply_conf_change(&entry)?,
                EntryType::EntryConfChangeV2 => {
                    // Never proposed by Tessera; committed all the same, so skipped in step.
                    self.state.applied = entry.index;
                    continue;
                }
            };
            match applied {
                Some(applied) => out.applied.push(applied),
                None => self.state.applied = entry.index,
            }
        }
        Ok(())
    }

    /// A normal entry. One that does not decode (written by a different version) is
    /// skipped on every peer alike, so the states stay equal.
    fn apply_command(&mut self, entry: &Entry) -> Option<Applied> {
        let command: Command = wire::decode(&entry.data, MAX_COMMAND_BYTES).ok()?;
        let outcome = self.state.apply(entry.index, &command);
        Some(Applied {
            index: entry.index,
            term: entry.term,
            proposal: self.own_proposal(&entry.context),
            command,
            outcome,
        })
    }

    fn apply_conf_change(&mut self, entry: &Entry) -> Result<Option<Applied>, PeerError> {
        let Ok(cc) = ConfChange::parse_from_bytes(&entry.data) else {
            return Ok(None);
        };
        let conf_state = self.node.apply_conf_change(&cc)?;
        self.node.store().set_conf_state(&conf_state)?;
        self.reconfigured = true;
        let Ok((proposal, change)) =
            wire::decode::<(ProposalId, MembershipChange)>(cc.get_context(), MAX_COMMAND_BYTES)
        else {
            return Ok(None);
        };
        let command = match change {
            MembershipChange::Join { id, http, quic } => Command::Member {
                id,
                http,
                quic,
                pid: 0,
            },
            MembershipChange::Leave { id } => Command::Leave { id },
        };
        let outcome = self.state.apply(entry.index, &command);
        let mine = proposal.peer == self.id() && proposal.incarnation == self.incarnation;
        Ok(Some(Applied {
            index: entry.index,
            term: entry.term,
            proposal: mine.then_some(proposal),
            command,
            outcome,
        }))
    }

    fn own_proposal(&self, context: &[u8]) -> Option<ProposalId> {
        let id: ProposalId = wire::decode(context, MAX_COMMAND_BYTES).ok()?;
        (id.peer == self.id() && id.incarnation == self.incarnation).then_some(id)
    }

    /// Replaces the applied log with a snapshot once enough entries have piled up.
    /// Compacts the log after `snapshot_every` applied entries that together hold at
    /// least half the last snapshot's bytes (so that a large journal is not written out
    /// whole every few entries: snapshots cost at most twice the log's own writes), and
    /// at once after a membership change: raft-rs installs a snapshot on a joining peer
    /// only when the snapshot's configuration names it, so the leader must hold one that
    /// does.
    fn compact_if_due(&mut self) -> Result<(), PeerError> {
        let first = self.node.store().first_index()?;
        let reconfigured = std::mem::take(&mut self.reconfigured);
        let entries_due = self.state.applied + 1 >= first + self.snapshot_every;
        let bytes_due = self.log_bytes >= self.snapshot_bytes / 2;
        let due = reconfigured || (entries_due && bytes_due);
        if !due {
            return Ok(());
        }
        let data = self.state.snapshot()?;
        self.snapshot_bytes = data.len() as u64;
        self.log_bytes = 0;
        self.node.store().compact(self.state.applied, data)?;
        Ok(())
    }
}

#[cfg(test)]
mod sim;
