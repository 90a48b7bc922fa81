//! The shard process (`tessera-shard`): one rank of a tensor-parallel group.
//!
//! - [`control`]: the async driver — one QUIC connection (mutual TLS) to the coordinator:
//!   register, receive the assignment and step plans, send results.
//! - [`worker`]: the compute thread — loads this rank's slice of the weights, joins the
//!   group's collective for each epoch, runs plans.
//! - `assign`: taking an assignment — load once, join the collective (NCCL in two steps:
//!   rank 0's unique id travels through the coordinator), size or carry the KV cache.
//! - [`engine`]: the step itself — sequences, one batched forward pass per step, rank 0's
//!   sampling shared through the collective.
//! - [`blocks`]: the KV block allocator — reference counts, free list, prefix cache with
//!   LRU eviction (a pure core).
//!
//! Lifecycle: `Register` → `Assign` (load, join, `Ready`) → `Step`/`StepDone`… A failure
//! sends `Failed` naming the rank to blame and waits, weights kept, for a new `Assign`.

mod assign;
pub mod blocks;
pub mod control;
pub mod engine;
mod error;
pub mod worker;

pub use error::ShardError;
