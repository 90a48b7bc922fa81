//! The replicated state machine: what every coordinator peer agrees on, changed only by
//! [`Command`]s committed in the Raft log, applied in log order by [`ClusterState::apply`].
//!
//! - members: each peer's id and addresses;
//! - groups: each group's epoch and the shards registered in it;
//! - models: each served model's files and groups, as the leader's topology names them;
//! - the topology applied through the API (`tessera topology apply`), which replaces the
//!   peers' files for groups and models;
//! - the request journal: every accepted request (its tokens, parameters and priority), the
//!   tokens checkpointed as sent to its client, and its completion. The leader keeps it
//!   within a byte budget ([`journal`]): [`Command::Prune`] drops finished requests once
//!   their retention has passed (earlier when the journal is over its budget) and open
//!   ones left past their time to live, so the journal, and with it every snapshot, stays
//!   bounded.
//!
//! `apply` is a pure function of the state and the command: no clock, no randomness (times
//! come inside commands, from the proposing leader), so every peer that applies the same
//! log holds the same state, and [`ClusterState::snapshot`] of one peer restores
//! ([`ClusterState::restore`]) into exactly the state of the others.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tessera_comm::proto::FinishReason;
use tessera_comm::wire;
use tessera_topology::PeerId;

use crate::engine::GenerateRequest;

pub mod journal;
pub mod rollout;
pub mod snapshot;

pub use journal::JournalUsage;
pub use rollout::{Rollout, RolloutCommand};

/// A request's id: the `id` of its response object (`cmpl-…`, `chatcmpl-…`).
pub type RequestId = String;

/// The largest snapshot a peer encodes or accepts, less room for the Raft message around
/// it. A snapshot crosses the network in frames of its own ([`super::transport`]), so it
/// is not bounded by one frame; the journal budget keeps it far below this.
pub const MAX_SNAPSHOT_BYTES: usize = wire::MAX_LARGE_BYTES - (1 << 20);

/// One change to the replicated state, as the leader proposes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// A coordinator peer's addresses and process id (added, or changed on restart; pid 0
    /// until the process announces itself).
    Member {
        id: PeerId,
        http: String,
        quic: String,
        pid: u32,
    },
    /// A coordinator peer left the configuration.
    Leave { id: PeerId },
    /// A model the cluster serves: its files and the groups that serve it.
    Model { name: String, record: ModelRecord },
    /// A shard registered in `group` at `epoch`.
    ShardUp {
        group: String,
        rank: u32,
        epoch: u64,
        host: String,
        pid: u32,
    },
    /// `group` is fenced: plans of an older epoch are refused from now on.
    Fence { group: String, epoch: u64 },
    /// A request is accepted: its stream may start once this is committed.
    Accept {
        id: RequestId,
        request: GenerateRequest,
        at_ms: u64,
    },
    /// Tokens sent to the client, from token `offset` of the completion on.
    Progress {
        id: RequestId,
        offset: u32,
        tokens: Vec<u32>,
    },
    /// The request ended (all its tokens were checkpointed before). `reason` is `None`
    /// when it ended without finishing: its client went away, or its group failed it
    /// (such a request may be reopened: [`Command::Reopen`]).
    Finish {
        id: RequestId,
        reason: Option<FinishReason>,
        at_ms: u64,
    },
    /// Drops every request that finished before `before_ms`. Written by earlier versions
    /// (logs may hold it); leaders now propose [`Command::Prune`].
    Expire { before_ms: u64 },
    /// Bounds the journal: drops every request that finished before `finished_before_ms`
    /// and every request still open that was accepted before `open_before_ms` (one that no
    /// leader will finish: its `Accept` committed after its proposer gave up, say) unless
    /// the leader names it as `running`, then finished requests, earliest finished first,
    /// until the journal counts at most `max_bytes` ([`Journaled::bytes`]). Open requests
    /// are never dropped for bytes.
    Prune {
        finished_before_ms: u64,
        open_before_ms: u64,
        max_bytes: u64,
        running: Vec<RequestId>,
    },
    /// A request that ended without a reason (its client went away, its group failed it)
    /// runs again, resumed by its client: it is open once more (and counted so).
    Reopen { id: RequestId },
    /// `group` is drained (taken out of routing for maintenance), or serves again.
    Drain { group: String, drained: bool },
    /// A model's versions change: a deploy, a promotion or a rollback ([`rollout`]).
    Rollout(RolloutCommand),
    /// A topology applied through the API: from now on its groups and models are the
    /// cluster's (`models`, each with its files and groups, replace the recorded ones).
    /// Groups and models it drops are forgotten, with their records and versions.
    /// Refused unless `generation` is the one after the state's: the proposer checked it
    /// against the topology that was in force.
    Topology {
        generation: u64,
        path: String,
        text: String,
        models: BTreeMap<String, ModelRecord>,
    },
}

/// What applying a command did. Anything but `Applied` left the state unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// The request id is already in the journal (a retried proposal).
    Duplicate,
    /// A registration or fence of an epoch older than the group's.
    StaleEpoch {
        current: u64,
    },
    /// No such request in the journal (never accepted, or expired).
    UnknownRequest,
    /// Progress that would leave a gap, or that contradicts tokens already recorded.
    BadProgress {
        recorded: u32,
    },
    /// A reopen of a request that is open, or that finished with a reason.
    NotReopenable,
    /// A rollout command that does not fit the model's versions (or names an unknown
    /// model), or a model recorded from a file where an applied topology names them: a
    /// sentence saying what to change.
    Refused {
        reason: String,
    },
}

/// The last topology applied through the API, as its text: every peer parses it the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedTopology {
    /// 1 for the first one applied, then one more each time.
    pub generation: u64,
    /// The file it was read from, against whose directory relative paths resolve.
    pub path: String,
    pub text: String,
}

/// A coordinator peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub http: String,
    pub quic: String,
    pub pid: u32,
}

/// A served model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Its files, as the recording leader's topology resolves them.
    pub path: String,
    pub groups: Vec<String>,
}

/// A shard as last registered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    pub epoch: u64,
    pub host: String,
    pub pid: u32,
}

/// A group's fencing epoch and shards, and whether it is drained.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub epoch: u64,
    pub shards: BTreeMap<u32, ShardRecord>,
    /// Taken out of routing for maintenance ([`Command::Drain`]): new requests go to the
    /// model's other groups; the requests it runs finish.
    pub drained: bool,
}

/// One request of the journal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Journaled {
    /// The log index of its acceptance: the order in which requests are resumed.
    pub accepted_index: u64,
    pub accepted_ms: u64,
    pub request: GenerateRequest,
    /// Completion tokens checkpointed as sent to the client.
    pub sent: Vec<u32>,
    /// How (see [`Command::Finish`]) and when it ended.
    pub finished: Option<(Option<FinishReason>, u64)>,
}

/// Everything the peers replicate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    /// The index of the last applied entry.
    pub applied: u64,
    pub members: BTreeMap<PeerId, Member>,
    pub groups: BTreeMap<String, GroupRecord>,
    pub models: BTreeMap<String, ModelRecord>,
    /// The versions of each model that was ever deployed to (a model absent here serves
    /// its topology's files as version 1: [`Rollout::initial`]).
    pub rollouts: BTreeMap<String, Rollout>,
    /// `None` until a topology is applied: each peer's file names groups and models.
    /// Shared with every summary (its text may be long; summaries are made often).
    pub topology: Option<Arc<AppliedTopology>>,
    pub journal: BTreeMap<RequestId, Journaled>,
    /// What the journal holds, kept as it changes ([`ClusterState::journal_usage`]);
    /// recomputed from the journal on restore.
    #[serde(skip)]
    usage: JournalUsage,
}

/// The replicated state without its request journal (and without `applied`): small, and
/// changed only by membership and group events, so it is published to watchers on every
/// change. The journal is read where it lives ([`super::node::NodeHandle::read`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub members: BTreeMap<PeerId, Member>,
    pub groups: BTreeMap<String, GroupRecord>,
    pub models: BTreeMap<String, ModelRecord>,
    pub rollouts: BTreeMap<String, Rollout>,
    pub topology: Option<Arc<AppliedTopology>>,
}

impl Summary {
    /// The versions of `model` (version 1 only, when it was never deployed to); for a
    /// model not recorded, why not.
    pub fn versions(&self, model: &str) -> Result<Rollout, rollout::Refusal> {
        rollout::versions_of(&self.models, &self.rollouts, model).map(|(r, _)| r)
    }
}

impl ClusterState {
    /// Members and groups.
    pub fn summary(&self) -> Summary {
        Summary {
            members: self.members.clone(),
            groups: self.groups.clone(),
            models: self.models.clone(),
            rollouts: self.rollouts.clone(),
            topology: self.topology.clone(),
        }
    }

    /// Applies the command of log entry `index`. Entries at or below
    /// [`ClusterState::applied`] were applied already (a replay after a restart) and
    /// change nothing.
    pub fn apply(&mut self, index: u64, command: &Command) -> Outcome {
        if index <= self.applied {
            return Outcome::Applied;
        }
        self.applied = index;
        match command {
            Command::Member {
                id,
                http,
                quic,
                pid,
            } => {
                self.members.insert(
                    *id,
                    Member {
                        http: http.clone(),
                        quic: quic.clone(),
                        pid: *pid,
                    },
                );
                Outcome::Applied
            }
            Command::Leave { id } => {
                self.members.remove(id);
                Outcome::Applied
            }
            Command::Model { name, record } => {
                if self.topology.is_some() {
                    // A leader recording its file's models, which an applied topology
                    // replaced: the applied one stands.
                    let reason = "an applied topology names the models".to_string();
                    return Outcome::Refused { reason };
                }
                self.models.insert(name.clone(), record.clone());
                Outcome::Applied
            }
            Command::ShardUp {
                group,
                rank,
                epoch,
                host,
                pid,
            } => {
                let current = self.groups.get(group).map_or(0, |g| g.epoch);
                if *epoch < current {
                    return Outcome::StaleEpoch { current };
                }
                let record = self.groups.entry(group.clone()).or_default();
                record.epoch = *epoch;
                record.shards.insert(
                    *rank,
                    ShardRecord {
                        epoch: *epoch,
                        host: host.clone(),
                        pid: *pid,
                    },
                );
                Outcome::Applied
            }
            Command::Fence { group, epoch } => {
                let current = self.groups.get(group).map_or(0, |g| g.epoch);
                if *epoch <= current {
                    return Outcome::StaleEpoch { current };
                }
                let record = self.groups.entry(group.clone()).or_default();
                record.epoch = *epoch;
                // Shards of older epochs must register again.
                record.shards.clear();
                Outcome::Applied
            }
            Command::Accept { id, request, at_ms } => {
                if self.journal.contains_key(id) {
                    return Outcome::Duplicate;
                }
                let entry = Journaled {
                    accepted_index: index,
                    accepted_ms: *at_ms,
                    request: request.clone(),
                    sent: Vec::new(),
                    finished: None,
                };
                self.usage.add(id, &entry);
                self.journal.insert(id.clone(), entry);
                Outcome::Applied
            }
            Command::Progress { id, offset, tokens } => {
                let Some(entry) = self.journal.get_mut(id) else {
                    return Outcome::UnknownRequest;
                };
                self.usage.remove(id, entry);
                let outcome = progress(&mut entry.sent, *offset as usize, tokens);
                self.usage.add(id, entry);
                outcome
            }
            Command::Finish { id, reason, at_ms } => {
                let Some(entry) = self.journal.get_mut(id) else {
                    return Outcome::UnknownRequest;
                };
                if entry.finished.is_none() {
                    self.usage.remove(id, entry);
                    entry.finished = Some((*reason, *at_ms));
                    self.usage.add(id, entry);
                }
                Outcome::Applied
            }
            Command::Expire { before_ms } => {
                self.prune(*before_ms, 0, u64::MAX, &[]);
                Outcome::Applied
            }
            Command::Prune {
                finished_before_ms,
                open_before_ms,
                max_bytes,
                running,
            } => {
                self.prune(*finished_before_ms, *open_before_ms, *max_bytes, running);
                Outcome::Applied
            }
            Command::Reopen { id } => {
                let Some(entry) = self.journal.get_mut(id) else {
                    return Outcome::UnknownRequest;
                };
                if !matches!(entry.finished, Some((None, _))) {
                    return Outcome::NotReopenable;
                }
                self.usage.remove(id, entry);
                entry.finished = None;
                self.usage.add(id, entry);
                Outcome::Applied
            }
            Command::Drain { group, drained } => {
                self.groups.entry(group.clone()).or_default().drained = *drained;
                Outcome::Applied
            }
            Command::Rollout(command) => self.rollout(command),
            Command::Topology {
                generation,
                path,
                text,
                models,
            } => {
                let current = self.topology.as_ref().map_or(0, |t| t.generation);
                if *generation != current + 1 {
                    let reason = format!(
                        "another topology was applied meanwhile (generation {current}): \
                         apply yours again"
                    );
                    return Outcome::Refused { reason };
                }
                self.topology = Some(Arc::new(AppliedTopology {
                    generation: *generation,
                    path: path.clone(),
                    text: text.clone(),
                }));
                self.forget_unlisted(models);
                Outcome::Applied
            }
        }
    }

    /// `models` replace the recorded ones, and what they no longer name (groups, models
    /// and their versions) is forgotten.
    fn forget_unlisted(&mut self, models: &BTreeMap<String, ModelRecord>) {
        self.models = models.clone();
        self.rollouts.retain(|name, _| models.contains_key(name));
        self.groups
            .retain(|name, _| models.values().any(|m| m.groups.contains(name)));
    }

    /// Applies a rollout command to its model's versions, all or nothing.
    fn rollout(&mut self, command: &RolloutCommand) -> Outcome {
        let name = command.model();
        let applied = rollout::versions_of(&self.models, &self.rollouts, name)
            .and_then(|(mut r, record)| r.apply(command, &record.groups).map(|()| r));
        match applied {
            Ok(rollout) => {
                self.rollouts.insert(name.to_string(), rollout);
                Outcome::Applied
            }
            Err(refusal) => Outcome::Refused { reason: refusal.0 },
        }
    }

    /// The requests still to finish, in the order they were accepted.
    pub fn unfinished(&self) -> Vec<(&RequestId, &Journaled)> {
        let mut open: Vec<_> = self
            .journal
            .iter()
            .filter(|(_, j)| j.finished.is_none())
            .collect();
        open.sort_by_key(|(_, j)| j.accepted_index);
        open
    }

    /// What the journal holds: entries, open entries, and their bytes.
    pub fn journal_usage(&self) -> JournalUsage {
        self.usage
    }

    /// The state as snapshot bytes (versioned: [`snapshot`]); refuses more than
    /// [`MAX_SNAPSHOT_BYTES`].
    pub fn snapshot(&self) -> Result<Vec<u8>, tessera_comm::CommError> {
        snapshot::encode(self)
    }

    /// The state a snapshot of any version this peer knows holds; refuses more than
    /// [`MAX_SNAPSHOT_BYTES`].
    pub fn restore(bytes: &[u8]) -> Result<ClusterState, tessera_comm::CommError> {
        if bytes.is_empty() {
            // The empty snapshot of a peer that has never compacted.
            return Ok(ClusterState::default());
        }
        snapshot::decode(bytes)
    }
}

/// Records `tokens` as sent from `offset` on: a retried checkpoint that overlaps what is
/// recorded adds only its new tokens; one that would leave a gap, or that disagrees with
/// recorded tokens, changes nothing.
fn progress(sent: &mut Vec<u32>, offset: usize, tokens: &[u32]) -> Outcome {
    let recorded = sent.len();
    if offset > recorded {
        return Outcome::BadProgress {
            recorded: recorded as u32,
        };
    }
    let overlap = (recorded - offset).min(tokens.len());
    if sent[offset..offset + overlap] != tokens[..overlap] {
        return Outcome::BadProgress {
            recorded: recorded as u32,
        };
    }
    sent.extend_from_slice(&tokens[overlap..]);
    Outcome::Applied
}

#[cfg(test)]
mod tests;
