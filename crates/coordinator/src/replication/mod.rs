//! Replication of the coordinator's state across its peers with Raft (TiKV's raft-rs).
//!
//! - [`store`]: a peer's durable Raft log, hard state and snapshot (redb), implementing
//!   raft-rs's `Storage`.
//! - [`state`]: the replicated state machine — members, groups and epochs, the request
//!   journal — a pure `apply` of committed commands.

pub mod state;
pub mod store;

pub use store::{LogStore, StoreError};
