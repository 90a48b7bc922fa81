//! The shard process (`tessera-shard`): one rank of a tensor-parallel group.
//!
//! - [`control`]: the async driver — one QUIC connection (mutual TLS) to the coordinator:
//!   register, receive the assignment and step plans, send results.
//! - [`worker`]: the compute thread — loads this rank's slice of the weights, joins the
//!   group's collective for each epoch (NCCL in two steps: rank 0's unique id travels
//!   through the coordinator), sizes or carries the KV cache, runs plans.
//! - [`runner`]: the step itself ([`runner::StepRunner`]) — sequences, one batched forward
//!   pass per step, rank 0's sampling shared through the collective.
//! - [`blocks`]: the KV block allocator — reference counts, free list, prefix cache with
//!   LRU eviction (a pure core).
//! - [`stats`]: the process's memory and (through NVML) its GPU, sent every few seconds.
//!
//! Feature `cuda` (on by default): shards on `cuda:N` devices and NCCL groups. Without it
//! the shard refuses a `cuda:N` device at start.
//!
//! Lifecycle: `Register` → `Assign` (load, join, `Ready`) → `Step`/`StepDone`… A failure
//! sends `Failed` naming the rank to blame and waits, weights kept, for a new `Assign`.

#![forbid(unsafe_code)]

pub mod blocks;
pub mod control;
mod error;
pub mod pinning;
pub mod runner;
pub mod stats;
pub mod worker;

pub use error::ShardError;
