//! The boundary between the HTTP API and whatever runs requests: a validated
//! [`GenerateRequest`] in, a [`TokenStream`] of [`TokenEvent`]s (or a typed [`WireError`])
//! out, plus the cluster's status for `/ready`, `/v1/cluster` and the status page.
//!
//! The coordinator's [`crate::cluster::Cluster`] implements [`Engine`]; API tests use a mock.

use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use tessera_comm::proto::{Epoch, FinishReason, Sampling, Term, WireError};
use tessera_topology::PeerId;
use tokio::sync::mpsc;

use crate::error::CoordinatorError;
use crate::live::TopologyChange;
use crate::replication::state::AppliedTopology;
use crate::replication::state::rollout::{Canary, RolloutEvent, Version};

pub use tessera_comm::proto::TokenLogprobs;

/// One sequence to generate, already validated and tokenized by the API layer (and, as
/// accepted, journaled in the replicated state).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The topology's model name.
    pub model: String,
    pub prompt: Vec<u32>,
    /// At least 1; prompt + max_tokens fits the model's context.
    pub max_tokens: u32,
    /// Includes `logprobs`: how many top alternatives each token reports, if any.
    pub sampling: Sampling,
    /// End-of-sequence ids of the model plus the request's stop ids.
    pub stop_token_ids: Vec<u32>,
    /// Stop strings: the API cuts the text at the first match and ends the sequence. The
    /// journal keeps them, so that a resumed stream ends where the original did.
    pub stop: Vec<String>,
    /// Lower runs first (vLLM's convention); 0 by default. Among equal priorities,
    /// earlier requests run first.
    pub priority: i32,
}

/// One sampled token of a sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub token: u32,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
    /// Set on the last token of the sequence.
    pub finish: Option<FinishReason>,
}

/// The tokens of one sequence, as they are sampled. It ends after the event with a
/// `finish`, or with one `Err` (the group failed, the request was cancelled). Dropping the
/// receiver cancels the sequence: the scheduler stops planning it and its KV blocks are
/// freed on every shard.
#[derive(Debug)]
pub struct TokenStream {
    events: mpsc::UnboundedReceiver<Result<TokenEvent, WireError>>,
    /// The model version that serves it, where known (a rollout's
    /// `x-tessera-model-version`).
    pub version: Option<u32>,
}

impl TokenStream {
    /// A stream of `events`, of no known version.
    pub fn new(events: mpsc::UnboundedReceiver<Result<TokenEvent, WireError>>) -> TokenStream {
        TokenStream {
            events,
            version: None,
        }
    }

    /// The same stream, served by model version `version`.
    pub fn versioned(self, version: Option<u32>) -> TokenStream {
        TokenStream { version, ..self }
    }

    /// The next event; `None` once the sender is gone.
    pub async fn recv(&mut self) -> Option<Result<TokenEvent, WireError>> {
        self.events.recv().await
    }
}

/// Every token of a finished sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    /// One entry per token when the request asked for logprobs, else empty.
    pub logprobs: Vec<TokenLogprobs>,
    pub finish: FinishReason,
}

/// Reads `stream` to its end.
pub async fn collect(mut stream: TokenStream) -> Result<GenerateOutput, WireError> {
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    while let Some(event) = stream.recv().await {
        let event = event?;
        tokens.push(event.token);
        logprobs.extend(event.logprobs);
        if let Some(finish) = event.finish {
            return Ok(GenerateOutput {
                tokens,
                logprobs,
                finish,
            });
        }
    }
    Err(CoordinatorError::StreamEndedEarly.into())
}

/// A boxed future, so that [`Engine`] stays object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs generation requests.
pub trait Engine: Send + Sync + 'static {
    /// Queues `request` on a group of its model and returns its token stream. `id` names
    /// it in the request journal: the response's id, with `/N` for choice N > 0. Errors
    /// carry their class: `CapacityExhausted` when every queue is full (HTTP 429),
    /// `InvalidRequest` when it could never fit the group's KV cache, `Unavailable` when no
    /// group can take it.
    fn generate(
        &self,
        id: String,
        request: GenerateRequest,
    ) -> BoxFuture<'_, Result<TokenStream, WireError>>;

    /// Whether a request for `model` would be queued now: `Err` with `CapacityExhausted`
    /// when every group's waiting queue is full. Cheap; the API asks before tokenizing.
    fn admission(&self, model: &str) -> Result<(), WireError>;

    /// True when at least one group serving `model` can take a step now.
    fn ready(&self, model: &str) -> bool;

    /// Every group and shard, for `/v1/cluster` and the status page.
    fn status(&self) -> ClusterStatus;

    /// Whether the engine still works: `Err` names what stopped (a coordinator peer's
    /// Raft). `/health` answers 503 then.
    fn live(&self) -> Result<(), String> {
        Ok(())
    }

    /// Journaled request `id` again: `None` when the journal does not hold it (never
    /// accepted, or expired). Engines without a journal hold nothing.
    fn resume(&self, id: String) -> BoxFuture<'_, Result<Option<Resumed>, WireError>> {
        let _ = id;
        Box::pin(std::future::ready(Ok(None)))
    }

    /// Adds or removes a coordinator peer, once committed. Engines without replication
    /// have no peers to change.
    fn change_peers(&self, change: PeerChange) -> BoxFuture<'_, Result<(), WireError>> {
        let _ = change;
        Box::pin(std::future::ready(Err(
            CoordinatorError::NotReplicated.into()
        )))
    }

    /// Takes `group` out of routing (`drained`) or puts it back, once the change is
    /// committed: its status then. Engines without replication refuse.
    fn drain_group(
        &self,
        group: String,
        drained: bool,
    ) -> BoxFuture<'_, Result<GroupStatus, WireError>> {
        let _ = (group, drained);
        Box::pin(std::future::ready(Err(
            CoordinatorError::NotReplicated.into()
        )))
    }

    /// Changes `model`'s versions once committed (`None`: only reads them): its versions
    /// then. Engines without replication refuse.
    fn rollout(
        &self,
        model: String,
        action: Option<RolloutAction>,
    ) -> BoxFuture<'_, Result<VersionsStatus, WireError>> {
        let _ = (model, action);
        Box::pin(std::future::ready(Err(
            CoordinatorError::NotReplicated.into()
        )))
    }

    /// Applies the topology `text` (read from file `path`) once committed: the groups and
    /// models it adds and removes. Engines without replication refuse.
    fn apply_topology(
        &self,
        path: String,
        text: String,
    ) -> BoxFuture<'_, Result<TopologyApplied, WireError>> {
        let _ = (path, text);
        Box::pin(std::future::ready(Err(
            CoordinatorError::NotReplicated.into()
        )))
    }

    /// The topology applied last, if any (`None`: each peer's file is in force).
    fn applied_topology(&self) -> Option<AppliedTopology> {
        None
    }
}

/// What `tessera topology apply` is answered.
#[derive(Clone, Debug, Serialize)]
pub struct TopologyApplied {
    /// The applied topology's generation (unchanged when there was nothing to change).
    pub generation: u64,
    #[serde(flatten)]
    pub change: TopologyChange,
}

/// A change to a model's versions, as the API asks it (`tessera model …`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RolloutAction {
    /// A new version from `path`: a canary of `canary_percent` on `groups` (by default
    /// the model's last group), or, without a percent and groups, stable on every group.
    Deploy {
        path: String,
        canary_percent: Option<u8>,
        groups: Vec<String>,
    },
    Promote,
    /// Back to version `to` (by default: the stable version from a canary, or the
    /// previous stable version).
    Rollback {
        to: Option<u32>,
    },
}

/// A model's versions and where each group stands, for `tessera model status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VersionsStatus {
    pub model: String,
    pub stable: u32,
    pub previous: Option<u32>,
    pub canary: Option<Canary>,
    /// Oldest first.
    pub versions: Vec<Version>,
    /// Deploys, promotions and rollbacks (automatic ones with their reason), oldest first.
    pub events: Vec<RolloutEvent>,
    pub groups: Vec<GroupVersion>,
}

/// The version a group serves, and the one it should.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GroupVersion {
    pub name: String,
    /// The version of its last served epoch (0 before its first).
    pub version: u32,
    pub target: u32,
    pub switching: bool,
    pub state: &'static str,
}

/// A membership change of the coordinator peers (one voter at a time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerChange {
    Add {
        id: PeerId,
        http: String,
        quic: String,
    },
    Remove {
        id: PeerId,
    },
}

/// A journaled request, resumed: what it asked, and its completion tokens from the first
/// on — those already generated at once, the rest as they come.
#[derive(Debug)]
pub struct Resumed {
    pub request: GenerateRequest,
    /// When it was accepted (Unix milliseconds).
    pub accepted_ms: u64,
    pub tokens: TokenStream,
}

/// The live state of the cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClusterStatus {
    /// The coordinator peers, as this peer sees them (empty without replication).
    pub peers: Vec<PeerStatus>,
    /// The models in the replicated state (empty without replication).
    pub models: Vec<ModelStatus>,
    pub groups: Vec<GroupStatus>,
}

/// A served model, as the replicated state records it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ModelStatus {
    pub name: String,
    /// Its files, as the recording leader's topology resolves them.
    pub path: String,
    pub groups: Vec<String>,
    /// Its stable version (1: the topology's files) and canary, if one runs.
    pub stable: u32,
    pub canary: Option<Canary>,
    /// Its last deploys, promotions and rollbacks (automatic ones with their reason).
    pub events: Vec<RolloutEvent>,
}

/// One coordinator peer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeerStatus {
    pub id: PeerId,
    /// Its HTTP API.
    pub http: String,
    /// `leader`, `follower`, or `unknown` while no leader is known.
    pub role: &'static str,
    /// The Raft term as this peer knows it.
    pub term: Term,
    /// Its process id, once it has announced itself.
    pub pid: Option<u32>,
    /// True for the peer that answered.
    pub this: bool,
}

/// One tensor-parallel group.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GroupStatus {
    pub name: String,
    pub model: String,
    pub tp: usize,
    /// `down` (a rank is missing), `assigning` (loading / joining), `serving`.
    pub state: &'static str,
    /// Taken out of routing (`tessera group drain`): it takes no new request.
    pub drained: bool,
    /// Out of routing while it moves to another model version (a rollout).
    pub switching: bool,
    /// The model version of the epoch it served last (0 before its first).
    pub version: u32,
    pub epoch: Epoch,
    /// Sequences with KV on the shards / waiting in the queue.
    pub running: usize,
    pub waiting: usize,
    /// KV blocks per rank, and those in use (the scheduler's count).
    pub kv_blocks: u32,
    pub kv_blocks_used: u32,
    pub block_size: u32,
    /// Tokens generated per second over the last few seconds.
    pub tokens_per_second: f64,
    /// Prompt tokens served from the prefix cache, since start.
    pub prefix_cache_hit_tokens: u64,
    pub shards: Vec<ShardStatus>,
}

/// One rank of a group.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ShardStatus {
    pub rank: u32,
    /// The topology's host name.
    pub host: String,
    /// `disconnected`, `connected`, `loading`, `ready`.
    pub state: &'static str,
    pub pid: Option<u32>,
    pub device: Option<String>,
    /// Weights this rank holds, once loaded.
    pub weight_bytes: u64,
    /// KV blocks this rank reported free after its last step.
    pub kv_blocks_free: u32,
}
