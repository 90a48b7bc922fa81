//! The topology file: one TOML file that describes a whole Tessera cluster — coordinator
//! peers, hosts, models and tensor-parallel groups with one shard entry per rank — and the
//! tensor-parallel slicing arithmetic that follows from it.
//!
//! The crate is a pure core: it takes the file's text and its path (for messages and for
//! resolving relative paths) and touches neither filesystem nor network — except
//! [`Topology::read`], the file-reading convenience every binary shares.
//!
//! - [`spec`]: [`TopologySpec`], the raw file contents (serde, `deny_unknown_fields`, every
//!   value with its byte span).
//! - [`Topology::parse`] / [`Topology::from_spec`]: the validated [`Topology`], or every
//!   [`TopologyIssue`] found — each with its line, column, field path, message and a
//!   sentence saying what to change.
//! - [`Topology::check_model`]: the rules that need the model's shape ([`ModelShape`]).
//! - [`plan_group`]: which attention heads, KV heads, MLP rows and vocabulary rows each rank
//!   holds ([`RankPlan`]). The model loader slices weights with these ranges.
//!
//! Drivers: `tessera topology check` (crate `cli`) prints the plan; the coordinator and the
//! shards read the same file through [`Topology::parse`].
//!
//! The file format, its defaults and every rule are documented in `docs/topology.md`.

#![forbid(unsafe_code)]

mod error;
mod issue;
mod parse;
mod plan;
mod read;
pub mod spec;
mod topology;
mod units;
mod validate;

pub use error::{PlanError, TopologyError};
pub use issue::{Location, Severity, Source, TopologyIssue};
pub use plan::{ModelShape, RankPlan, fitting_tps, plan_group};
pub use read::ReadError;
pub use spec::TopologySpec;
pub use topology::{
    Collective, CollectiveChoice, CoordinatorPeer, Device, Group, Host, Model, ModelDtype,
    ModelFormat, NetAddr, PeerId, Precision, Rank, Shard, Topology,
};
pub use units::{format_size, parse_size};
