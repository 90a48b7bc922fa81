//! The control protocol between shards and coordinators: closed enums, one per direction,
//! encoded with [`crate::wire`] in length-prefixed frames on one bidirectional QUIC stream
//! per shard connection.
//!
//! A connection opens with [`ShardMsg::Register`], which carries [`PROTOCOL_VERSION`]; a
//! coordinator that speaks another version answers [`CoordinatorMsg::Refused`]. Adding a
//! variant or a field is a version bump: bincode has no optional fields, and a message this
//! peer does not know is a decode error, never silently skipped.
//!
//! Lifecycle of a shard: `Register` → (`Assign` → `Loading`* → `Ready`) → (`Step` →
//! `StepDone`)* … A failure anywhere is `Failed`; the coordinator then fences the group (a
//! new epoch) and, once every rank is connected again, sends a fresh `Assign`. Every plan
//! carries (term, epoch); a shard drops plans from an older one.
//!
//! Only the Raft leader among the coordinator peers drives shards: the others answer
//! `Register` with [`CoordinatorMsg::NotLeader`], and the shard moves on to the leader.
//! A shard also holds a standby connection ([`ShardMsg::Standby`]) to every peer, on
//! which a peer that becomes leader says so ([`CoordinatorMsg::Leading`]): a shard does
//! not wait for its connection to a dead leader to time out.

use std::fmt;

use serde::{Deserialize, Serialize};
use tessera_kernels::sampling::SamplingParams;
use tessera_topology::{PeerId, Rank};

use crate::collective::GroupToken;

/// Bumped on any change to the messages below.
pub const PROTOCOL_VERSION: u32 = 7;

/// A `u64` that names one kind of thing, so that ids of different kinds cannot be mixed
/// up. Transparent on the wire: bincode encodes it as the `u64` it wraps.
macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize,
            Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_type!(
    /// A sequence: one generation stream of a request. A coordinator leader numbers them
    /// from its Raft term up (`term << 40`), so sequences carried over from an earlier
    /// leader's epoch never share an id with new ones.
    SeqId
);

id_type!(
    /// A Raft term of the coordinator peers. The leader of a term drives the shards, and
    /// every assignment and plan carries it: a shard ignores an older term's (a deposed
    /// leader's) assignments and plans.
    Term
);

id_type!(
    /// One assignment of a group: a leader starts a new epoch whenever it (re)assigns the
    /// group (a start, a failure, a rank coming back). Plans, results and failures carry
    /// it, so that nothing of an earlier epoch is taken for the current one.
    Epoch
);

id_type!(
    /// A step of an epoch: consecutive from 0, so a shard notices a missed plan.
    StepId
);

impl Epoch {
    /// The epoch after this one.
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }
}

impl StepId {
    /// The step after this one.
    pub fn next(self) -> StepId {
        StepId(self.0 + 1)
    }
}

/// Shard → coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ShardMsg {
    Register(Register),
    /// Weight loading progress for the current assignment, in layers.
    Loading {
        epoch: Epoch,
        layers_done: u32,
        layers: u32,
        /// Bytes of this rank's slice taken so far.
        weight_bytes: u64,
    },
    Ready(Ready),
    StepDone(StepDone),
    /// The shard cannot go on with this epoch (collective aborted, load failed, bad plan).
    Failed {
        epoch: Epoch,
        error: WireError,
    },
    /// The first message of a standby connection to a coordinator peer that does not
    /// lead: checked like `Register`, then held open so the peer can say when it leads
    /// ([`CoordinatorMsg::Leading`]) and the shard moves over at once.
    Standby(Register),
    /// Rank 0 of an NCCL group: the unique id (128 bytes) of `epoch`'s communicator, for
    /// the coordinator to relay to the other ranks.
    NcclId {
        epoch: Epoch,
        id: Vec<u8>,
    },
    /// What the shard process uses, every few seconds, for the coordinator's metrics.
    Stats(ShardStats),
}

/// A shard process's use of its host and device, sampled when sent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardStats {
    /// Resident memory of the process.
    pub rss_bytes: u64,
    /// The process's GPU, as NVML sees it; `None` on a CPU shard or without NVML.
    pub gpu: Option<GpuStats>,
}

/// One GPU, through NVML (whole-device figures: every process on it counts).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuStats {
    /// The share of the last sample period in which a kernel ran, 0 to 1.
    pub utilization: f32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub temperature_celsius: f32,
    pub power_watts: f32,
}

/// The first message of a shard connection. The coordinator checks it against the
/// topology and against the identity in the shard's certificate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    pub version: u32,
    pub group: String,
    pub rank: Rank,
    pub pid: u32,
    /// The device it computes on, as written in the topology (`cpu`, `cuda:0`).
    pub device: String,
    /// The journaled sequences this rank still holds from its last epoch, with their KV
    /// intact (prompt complete, not finished): a new coordinator leader may carry them
    /// into its first epoch ([`Assignment::keep`]) instead of recomputing them.
    pub held: Vec<HeldSeq>,
}

/// A sequence a shard still holds, as it reports it when it registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSeq {
    pub seq: SeqId,
    /// The request journal's id ([`NewSeq::request`]).
    pub request: String,
    pub prompt_len: u32,
    /// Every token generated so far (every rank has them: rank 0 shares each sample).
    pub generated: Vec<u32>,
    /// Positions whose K/V is in the cache: prompt + generated − 1 (the last token is
    /// computed by the next decode).
    pub computed: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub epoch: Epoch,
    /// KV blocks this rank can hold (ranks of a group report the same number when their
    /// budgets are equal; the coordinator uses the minimum).
    pub kv_blocks: u32,
    /// Positions per KV block.
    pub block_size: u32,
    /// Bytes of weights this rank read from the model files (its slice only).
    pub weight_bytes: u64,
    /// The sequences of [`Assignment::keep`] this rank carried into the epoch.
    pub kept: Vec<SeqId>,
    /// How long this rank's warmup ([`Assignment::warmup`]) took, in milliseconds; `None`
    /// when it ran none (it carried its cache, or the assignment asked for none).
    pub warmup_ms: Option<u64>,
}

/// What a shard reports after executing one [`StepPlan`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepDone {
    pub epoch: Epoch,
    pub step: StepId,
    /// One entry per sequence that produced a token in this step. Filled by rank 0 (the
    /// sampling rank); other ranks send it empty.
    pub tokens: Vec<SeqToken>,
    /// KV blocks this rank can still allocate (free, or cached and unreferenced).
    pub free_blocks: u32,
    /// Prompt tokens of this step's new sequences found in the prefix cache (their KV was
    /// not recomputed), per sequence; only sequences with a hit are listed.
    pub cached: Vec<(SeqId, u32)>,
    pub timings: StepTimings,
}

/// A sampled token, and whether the sequence finished with it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeqToken {
    pub seq: SeqId,
    pub token: u32,
    pub finish: Option<FinishReason>,
    /// When the sequence asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
}

/// The log-probability of a sampled token under the model (log-softmax of the raw
/// logits, before penalties and temperature), and the most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// `(token, logprob)`, most likely first; as many as the request asked for.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// An end-of-sequence or stop token was sampled.
    Stop,
    /// `max_tokens` were generated (or the context is full).
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Where a step's time went on one rank, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTimings {
    /// From starting the step to finishing it.
    pub step_us: u64,
    /// Inside collective calls (part of `step_us`).
    pub collective_us: u64,
    /// Waiting for this plan after the previous step finished (the "bubble").
    pub idle_us: u64,
    /// Payload bytes this rank sent into collective calls.
    pub collective_bytes: u64,
}

/// Coordinator → shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordinatorMsg {
    /// Registration accepted: load (if not loaded), join the collective, report `Ready`.
    Assign(Assignment),
    Step(StepPlan),
    /// Finish the current step, then wait for a new assignment.
    Drain,
    /// Exit cleanly.
    Shutdown,
    /// Registration refused; the connection closes after this message.
    Refused {
        error: WireError,
    },
    /// This coordinator peer is not the Raft leader: register with `leader` (a peer id of
    /// the topology) when one is known, else try the other peers. The connection closes
    /// after this message.
    NotLeader {
        leader: Option<PeerId>,
    },
    /// On a standby connection: coordinator peer `peer` leads Raft term `term` now.
    Leading {
        peer: PeerId,
        term: Term,
    },
    /// The unique id of `epoch`'s NCCL communicator, from rank 0 (see [`Bootstrap::Nccl`]).
    NcclId {
        epoch: Epoch,
        id: Vec<u8>,
    },
}

/// A shard's place in its group for one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub term: Term,
    pub epoch: Epoch,
    /// Authenticates the group's collective connections for this epoch.
    pub token: GroupToken,
    pub bootstrap: Bootstrap,
    /// How long one collective call may wait for the other ranks.
    pub collective_deadline_ms: u64,
    /// Sequences to carry into this epoch with their KV cache (every rank reported them
    /// held, alike); every other sequence is freed. Empty: start with an empty cache.
    pub keep: Vec<SeqId>,
    /// The steps to run before saying `Ready` when the rank starts the epoch with a new
    /// KV cache (not when it carries its cache into the epoch).
    pub warmup: Warmup,
    /// The model version the epoch serves: a rank that holds another one's weights loads
    /// these (and starts with a new KV cache).
    pub model: ModelSource,
}

/// One version of a group's model: its files, as the coordinator's topology or a deploy
/// names them (`tessera model deploy`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSource {
    pub version: u32,
    pub path: String,
}

/// The largest steps the coordinator will plan for a group, which a rank runs on a new KV
/// cache before it says `Ready`: whatever the first real steps of that size would do for
/// the first time (allocations, page faults of fresh buffers, a GPU's decode graph
/// captures, its libraries' lazy set-up) is done before traffic. Every rank of a group gets the same
/// figures and caps them the same way (by its KV blocks and the model's context), so the
/// ranks' collective calls match.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warmup {
    /// Prompt tokens of the largest prefill step (the scheduler's step budget); 0: none.
    pub prefill_tokens: u32,
    /// Sequences of the largest decode step (the scheduler's running limit); 0: none.
    pub decode_seqs: u32,
}

impl Warmup {
    /// No warmup.
    pub const NONE: Warmup = Warmup {
        prefill_tokens: 0,
        decode_seqs: 0,
    };

    pub fn is_none(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

/// How the ranks of a group find each other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Bootstrap {
    /// tp = 1.
    Solo,
    /// One host: a shared-memory segment of this name (under `/dev/shm`).
    Shm { name: String },
    /// Any hosts: rank r listens on `peers[r]` (`host:port`).
    Tcp { peers: Vec<String> },
    /// cuda ranks: NCCL. Rank 0 makes the group's unique id and sends it
    /// ([`ShardMsg::NcclId`]); the coordinator relays it to every rank
    /// ([`CoordinatorMsg::NcclId`]), and each joins with it.
    Nccl,
}

impl Bootstrap {
    /// A one-host group's bootstrap for `epoch`. The segment's name carries a random
    /// suffix besides the group and the epoch: two clusters on one host may both name a
    /// group `g`, and must never open each other's segment.
    pub fn shm(group: &str, epoch: Epoch) -> Bootstrap {
        let nonce = u64::from_le_bytes(GroupToken::random().0[..8].try_into().expect("8 bytes"));
        Bootstrap::Shm {
            name: format!("tessera-{group}-e{epoch}-{nonce:016x}"),
        }
    }
}

/// One step for a group: a delta against the state the shards already hold.
///
/// Shards execute, in order: `free` (release the blocks of finished, cancelled or
/// preempted sequences), `new` (admit sequences, taking what the prefix cache holds of
/// their prompt), then one batched forward pass over every `prefill` chunk and one decode
/// token for each of `decode` that has not finished. A sequence samples when its prompt
/// is complete and on every decode. Rank 0 samples and the tokens reach the other ranks
/// through the collective, so a shard never waits for the coordinator to learn a token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub term: Term,
    pub epoch: Epoch,
    /// Consecutive within an epoch, from 0.
    pub step: StepId,
    pub free: Vec<SeqId>,
    pub new: Vec<NewSeq>,
    pub prefill: Vec<PrefillChunk>,
    pub decode: Vec<SeqId>,
}

/// Up to `tokens` more prompt tokens of a sequence (fewer when the prefix cache already
/// holds some; none when its prompt is complete).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillChunk {
    pub seq: SeqId,
    pub tokens: u32,
}

/// A sequence entering the group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewSeq {
    pub seq: SeqId,
    /// The request journal's id (`cmpl-…`, with `/N` for choice N > 0), which a shard
    /// reports with the sequence when it registers with a new leader; empty when the
    /// request is not journaled.
    pub request: String,
    pub prompt: Vec<u32>,
    /// Tokens already generated (and sent to the client) before the sequence was
    /// preempted: recomputed with the prompt, never sampled again.
    pub generated: Vec<u32>,
    pub sampling: Sampling,
    /// Tokens to generate at most, counting `generated`.
    pub max_tokens: u32,
    /// Tokens that end the sequence (end-of-sequence ids and request stop ids).
    pub stop_token_ids: Vec<u32>,
}

/// Sampling settings on the wire (the kernel's `SamplingParams`, with fixed-size types).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Always set: the coordinator draws one when the request has none, so every rank
    /// and every retry of the sequence samples the same way.
    pub seed: u64,
    /// `Some(k)`: report the sampled token's logprob and the `k` most likely tokens'.
    pub logprobs: Option<u8>,
}

impl Sampling {
    /// The kernels' parameters this stands for.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k as usize,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: Some(self.seed),
        }
    }
}

impl Default for Sampling {
    /// The kernels' neutral parameters (greedy, no limits, no penalties), seed 0, no
    /// logprobs.
    fn default() -> Sampling {
        let neutral = SamplingParams::default();
        Sampling {
            temperature: neutral.temperature,
            top_k: u32::try_from(neutral.top_k).unwrap_or(u32::MAX),
            top_p: neutral.top_p,
            min_p: neutral.min_p,
            repetition_penalty: neutral.repetition_penalty,
            presence_penalty: neutral.presence_penalty,
            frequency_penalty: neutral.frequency_penalty,
            seed: 0,
            logprobs: None,
        }
    }
}

/// The class of an error, decided once near its cause; it picks the HTTP status, the
/// metric label and the OpenAI error `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorClass {
    InvalidRequest,
    Unavailable,
    CapacityExhausted,
    DeadlineExceeded,
    Cancelled,
    Internal,
}

/// An error that crosses a process boundary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    pub class: ErrorClass,
    pub message: String,
    /// The rank to blame, when one is known (a collective names the rank that did not
    /// arrive).
    pub rank: Option<Rank>,
}
