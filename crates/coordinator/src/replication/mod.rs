//! Replication of the coordinator's state across its peers with Raft (TiKV's raft-rs).
//!
//! - [`store`]: a peer's durable Raft log, hard state and snapshot (redb), implementing
//!   raft-rs's `Storage`.
//! - [`state`]: the replicated state machine — members, groups and epochs, the request
//!   journal — a pure `apply` of committed commands.
//! - [`peer`]: one peer's Raft core (raft-rs `RawNode`, the store and the state),
//!   synchronous and deterministic, checked by a simulation with a simulated network.
//! - [`node`]: the driver of a peer — its own thread, ticks, a transport — and the handle
//!   callers propose through.
//! - [`transport`]: Raft messages between peers over QUIC with mutual TLS.
//! - [`membership`]: a peer's stored configuration against the topology's peers.
//! - [`linearizable`]: the linearizability checker the simulation's histories go through.
//! - [`log`]: raft-rs's `slog` records forwarded to `tracing`.

pub mod linearizable;
pub mod log;
pub mod membership;
pub mod node;
pub mod peer;
pub mod state;
pub mod store;
pub mod transport;

pub use store::{LogStore, StoreError};
