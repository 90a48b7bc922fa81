//! The coordinator (`tessera-coordinator`): accepts shard registrations, drives every
//! tensor-parallel group of the topology, and serves the HTTP API.
//!
//! - [`server`]: the QUIC control endpoint — mutual TLS, registration checks.
//! - [`group`]: one driver task per group (epochs, plans, deadlines, fencing) around a
//!   pure scheduler core.
//! - [`cluster`]: the groups by model; implements [`engine::Engine`] for the API.
//! - [`error`]: [`error::CoordinatorError`], what the coordinator refuses or fails, and
//!   its class; it becomes a wire error where it leaves.
//! - [`api`]: the OpenAI-compatible HTTP API over any [`engine::Engine`].
//! - [`metrics`]: Prometheus metric names and the recorder behind `GET /metrics`.
//! - [`replication`]: the Raft group of coordinator peers: log store, replicated state,
//!   peer core, driver and transport.
//! - [`leader`]: drives the groups while this peer leads, and journals every request.
//! - [`forward`]: followers pass API calls on to the leader.
//! - [`lifecycle`]: how a peer stops: drain, hand leadership over, exit; or fail stop.
//! - [`live`]: the topology in force (the file's, or the last applied through the API).

#![forbid(unsafe_code)]

pub mod api;
pub mod canary;
pub mod cluster;
pub mod engine;
pub mod error;
pub mod forward;
pub mod group;
pub mod leader;
pub mod lifecycle;
pub mod live;
pub mod metrics;
pub mod replication;
pub mod server;
