//! Everything that crosses a process boundary in Tessera.
//!
//! - [`proto`]: the closed, versioned control messages between shards and coordinators
//!   ([`proto::ShardMsg`], [`proto::CoordinatorMsg`]) and the step plan they carry.
//! - [`wire`]: bincode encoding with an explicit size limit, length-prefixed frames whose
//!   length is checked before anything is allocated, trailing bytes rejected.
//! - [`tls`] and [`certs`]: the cluster CA, one certificate per coordinator peer and shard
//!   (role and id in the subject alternative name), and the rustls verifiers that refuse a
//!   peer from another CA or with the wrong role.
//! - [`quic`]: quinn endpoints with mutual TLS and explicit transport limits (windows, stream
//!   counts, keep-alive, idle timeout).
//! - [`collective`]: the [`Collective`] trait (all-reduce sum, all-gather, broadcast,
//!   barrier) with CPU backends — shared memory on one host, a TCP ring between hosts — each
//!   call bounded by a deadline that names the rank that did not arrive.
//! - `nccl` (feature `nccl`): NCCL between GPU ranks (loaded at run time), every
//!   collective bounded by a deadline that aborts the communicator. It is the only unsafe
//!   code of this crate, and without the feature it is absent with cudarc.
//! - [`logging`]: the log lines every process writes (stderr, filtered by `TESSERA_LOG`).
//!
//! Drivers: the shard process (`tessera-shard`) owns one collective on its compute thread
//! and one control connection; the coordinator accepts the control connections.

#![deny(unsafe_code)]

pub mod certs;
pub mod collective;
mod error;
pub mod logging;
#[cfg(feature = "nccl")]
#[allow(unsafe_code)] // FFI to NCCL; each block names its invariant
pub mod nccl;
pub mod proto;
pub mod quic;
pub mod tls;
pub mod wire;

pub use collective::{Collective, CollectiveError, CollectiveStats, GroupToken, Solo};
pub use error::CommError;
