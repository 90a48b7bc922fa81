//! [`CoordinatorError`]: every failure the coordinator itself decides — a request it
//! refuses or cannot run, a peer change it will not make, a shard registration it turns
//! away — each with its [`ErrorClass`], decided here, once, near the cause.
//!
//! The routing, group, leader and registration code returns these; they become a
//! [`WireError`] only where they leave the coordinator's own code: a reply to the API's
//! [`crate::engine::Engine`] calls, an event on a sequence's token stream, a `Refused`
//! frame to a shard. The API turns the `WireError` into its HTTP answer.

use tessera_comm::CommError;
use tessera_comm::certs::Identity;
use tessera_comm::proto::{ErrorClass, WireError};
use tessera_topology::{PeerId, Rank};

use crate::replication::node::ProposalError;
use crate::replication::state::Outcome;

/// Why the coordinator refused or failed something.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    // Routing and the groups.
    #[error("no group serves model `{model}`")]
    NoGroupForModel { model: String },
    #[error(
        "every group of model `{model}` is drained for maintenance ({}); put one back with \
         `tessera group resume NAME`", drained.join(", ")
    )]
    ModelDrained { model: String, drained: Vec<String> },
    #[error(
        "every group of model `{model}` that is not drained is moving to another version \
         of it ({}); retry in a moment", switching.join(", ")
    )]
    ModelSwitching {
        model: String,
        switching: Vec<String>,
    },
    #[error("every group of model `{model}` has a full queue; retry later")]
    QueuesFull { model: String },
    #[error(
        "the request needs {needed_blocks} KV blocks but group {group} holds {kv_blocks}; \
         shorten the prompt or max_tokens"
    )]
    TooLarge {
        group: String,
        needed_blocks: u32,
        kv_blocks: u32,
    },
    #[error("group {group} has {waiting} requests waiting; retry later")]
    QueueFull { group: String, waiting: usize },
    #[error(
        "the request waited {waited_s} s in the queue of group {group}, which is busy; retry later"
    )]
    QueueTimeout { group: String, waited_s: u64 },
    /// `missing` is empty when every rank is connected (the group is still assigning).
    #[error("group {group} did not become ready within {waited_s} s{}", missing_ranks(.missing))]
    NotReady {
        group: String,
        waited_s: u64,
        missing: Vec<usize>,
    },
    /// The group's epoch ended under a sequence; `reason` names `rank`.
    #[error("group {group}: {reason}")]
    Fenced {
        group: String,
        rank: Rank,
        reason: String,
    },
    #[error("group {group}: the coordinator is shutting down")]
    GroupStopped { group: String },
    #[error("the sequence's stream ended without a finish")]
    StreamEndedEarly,

    // Leadership and the request journal.
    #[error(
        "the request journal is full: {open} requests still running hold {open_bytes} of its \
         {budget} bytes; retry later"
    )]
    JournalFull {
        open: u64,
        open_bytes: u64,
        budget: u64,
    },
    #[error(
        "the request would take {bytes} bytes of the request journal, whose whole budget is \
         {budget}; shorten the prompt or max_tokens"
    )]
    TooLargeForJournal { bytes: u64, budget: u64 },
    #[error("request {id} cannot run again: {outcome:?}")]
    NotReopened { id: String, outcome: Outcome },
    #[error("this coordinator peer ({me}) is not the leader; peer {leader} at http://{http} is")]
    NotLeader {
        me: PeerId,
        leader: PeerId,
        http: String,
    },
    #[error("no coordinator leader is elected yet; retry in a few seconds")]
    NoLeader,
    #[error("request {id} is already journaled ({outcome:?})")]
    AlreadyJournaled { id: String, outcome: Outcome },
    #[error("the request could not be journaled: {source}")]
    NotJournaled { source: ProposalError },
    #[error("request {id} is running already")]
    AlreadyRunning { id: String },
    /// `ending` is how its run ended, as the journal's tail says.
    #[error("the request ended unfinished ({ending}); retry")]
    EndedUnfinished { ending: String },

    // Peer membership.
    #[error("this coordinator is not replicated: it has no peers to change")]
    NotReplicated,
    #[error("peer {id} is a member already")]
    AlreadyMember { id: PeerId },
    #[error("peer {id} is not a member (members: {:?})", peer_numbers(.members))]
    NotMember { id: PeerId, members: Vec<PeerId> },
    #[error("the last peer cannot be removed")]
    LastPeer,
    #[error("the membership change was not committed: {source}")]
    MembershipNotCommitted { source: ProposalError },
    #[error("the drain of group `{group}` was not committed: {source}")]
    DrainNotCommitted {
        group: String,
        source: ProposalError,
    },

    // Model rollouts.
    #[error("model `{model}`: {reason}")]
    RolloutRefused { model: String, reason: String },
    #[error("`{path}` cannot be deployed: {reason}")]
    BadModelPath { path: String, reason: String },
    #[error("the rollout of model `{model}` was not committed: {source}")]
    RolloutNotCommitted {
        model: String,
        source: ProposalError,
    },

    // Topologies applied through the API.
    #[error("the topology cannot be applied: {reason}")]
    TopologyRefused { reason: String },
    #[error("the topology was not committed: {source}")]
    TopologyNotCommitted { source: ProposalError },

    // Forwarding to the leader.
    #[error("forwarding to the leader (peer {leader}, QUIC address {quic}) failed: {reason}")]
    ForwardFailed {
        leader: PeerId,
        quic: String,
        reason: String,
    },

    // Shard registration.
    #[error("the first message must be Register")]
    FirstNotRegister,
    #[error("bad registration frame: {source}")]
    BadRegistration { source: CommError },
    #[error(
        "protocol version {version} is not supported (this coordinator speaks {supported}); \
         run the same Tessera version everywhere"
    )]
    ProtocolVersion { version: u32, supported: u32 },
    #[error(
        "a {identity:?} certificate cannot register as a shard; use the shard's own certificate"
    )]
    NotAShard { identity: Identity },
    #[error(
        "the certificate is for group {group} rank {rank}, but the shard registered as \
         group {registered_group} rank {registered_rank}"
    )]
    CertificateMismatch {
        group: String,
        rank: Rank,
        registered_group: String,
        registered_rank: Rank,
    },
    #[error("group `{group}` is not in the topology")]
    UnknownGroup { group: String },
    #[error("group `{group}` has tp = {tp}; rank {rank} does not exist")]
    NoSuchRank {
        group: String,
        tp: usize,
        rank: Rank,
    },
}

impl CoordinatorError {
    /// The class the API answers with (HTTP status, metric label, OpenAI `type`).
    pub fn class(&self) -> ErrorClass {
        use CoordinatorError as E;
        match self {
            E::QueuesFull { .. } | E::QueueFull { .. } | E::QueueTimeout { .. } => {
                ErrorClass::CapacityExhausted
            }
            E::JournalFull { .. } => ErrorClass::Unavailable,
            E::StreamEndedEarly => ErrorClass::Internal,
            E::NotReady { .. }
            | E::Fenced { .. }
            | E::GroupStopped { .. }
            | E::NotLeader { .. }
            | E::NoLeader
            | E::NotJournaled { .. }
            | E::EndedUnfinished { .. }
            | E::MembershipNotCommitted { .. }
            | E::ModelDrained { .. }
            | E::ModelSwitching { .. }
            | E::DrainNotCommitted { .. }
            | E::RolloutNotCommitted { .. }
            | E::TopologyNotCommitted { .. }
            | E::ForwardFailed { .. } => ErrorClass::Unavailable,
            E::NoGroupForModel { .. }
            | E::TooLarge { .. }
            | E::TooLargeForJournal { .. }
            | E::NotReopened { .. }
            | E::AlreadyJournaled { .. }
            | E::AlreadyRunning { .. }
            | E::NotReplicated
            | E::AlreadyMember { .. }
            | E::NotMember { .. }
            | E::LastPeer
            | E::FirstNotRegister
            | E::BadRegistration { .. }
            | E::ProtocolVersion { .. }
            | E::NotAShard { .. }
            | E::CertificateMismatch { .. }
            | E::UnknownGroup { .. }
            | E::RolloutRefused { .. }
            | E::BadModelPath { .. }
            | E::TopologyRefused { .. }
            | E::NoSuchRank { .. } => ErrorClass::InvalidRequest,
        }
    }

    /// The rank to blame, when one is known: the rank a fence names.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            CoordinatorError::Fenced { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

/// The boundary: what leaves the coordinator's code as a typed wire error.
impl From<CoordinatorError> for WireError {
    fn from(error: CoordinatorError) -> WireError {
        WireError {
            class: error.class(),
            rank: error.rank(),
            message: error.to_string(),
        }
    }
}

/// ` (rank 0, 2 not connected)`, or nothing when every rank is.
fn missing_ranks(missing: &[usize]) -> String {
    if missing.is_empty() {
        return String::new();
    }
    let ranks: Vec<String> = missing.iter().map(usize::to_string).collect();
    format!(" (rank {} not connected)", ranks.join(", "))
}

/// Peer ids as plain numbers, as the members list has always been written.
fn peer_numbers(members: &[PeerId]) -> Vec<u64> {
    members.iter().map(|p| p.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_values_and_fences_blame_their_rank() {
        let wire = WireError::from(CoordinatorError::Fenced {
            group: "g0".into(),
            rank: Rank(1),
            reason: "rank 1 disconnected".into(),
        });
        assert_eq!(wire.class, ErrorClass::Unavailable);
        assert_eq!(wire.rank, Some(Rank(1)));
        assert_eq!(wire.message, "group g0: rank 1 disconnected");
        let not_ready = CoordinatorError::NotReady {
            group: "g0".into(),
            waited_s: 60,
            missing: vec![0, 2],
        };
        assert_eq!(
            not_ready.to_string(),
            "group g0 did not become ready within 60 s (rank 0, 2 not connected)"
        );
        let members = CoordinatorError::NotMember {
            id: PeerId(4),
            members: vec![PeerId(1), PeerId(2)],
        };
        assert_eq!(
            members.to_string(),
            "peer 4 is not a member (members: [1, 2])"
        );
        assert_eq!(members.class(), ErrorClass::InvalidRequest);
    }
}
