//! The validated topology: [`Topology`] and its parts. A value of these types obeys every
//! rule that can be checked without the model (see `docs/topology.md`); the rules that need
//! the model's shape run in [`Topology::check_model`].

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize, Serializer};

use crate::error::TopologyError;
use crate::issue::{Location, Severity, Source, TopologyIssue};
use crate::plan::{ModelShape, RankPlan, check_tp, plan_group};
use crate::spec::TopologySpec;
use crate::{PlanError, parse, validate};

/// The position of a shard in its tensor-parallel group, `0..tp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The raft id of a coordinator peer (at least 1: raft reserves 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A listen address: an IP address or DNS name, and a port (never 0).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NetAddr {
    pub host: String,
    pub port: u16,
}

impl NetAddr {
    /// The host part as an IP address, if it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// `0.0.0.0` or `::`: every interface.
    pub fn is_wildcard(&self) -> bool {
        self.ip().is_some_and(|ip| ip.is_unspecified())
    }
}

impl fmt::Display for NetAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for NetAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// One raft peer of the coordinator group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CoordinatorPeer {
    pub id: PeerId,
    /// The [`Host`] it runs on.
    pub host: String,
    /// Raft and control traffic (QUIC with mutual TLS): bound and dialed at this address.
    pub quic: NetAddr,
    /// The HTTP API.
    pub http: NetAddr,
    /// Raft log and snapshots, resolved against the topology file's directory.
    pub data_dir: PathBuf,
}

/// One machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Host {
    pub name: String,
    /// IP address or DNS name; shards listen on `address:port`.
    pub address: String,
}

/// How weights are stored once loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelDtype {
    /// The type stored in the file (quantized GGUF stays quantized).
    Auto,
    F32,
    Bf16,
    F16,
}

impl ModelDtype {
    /// As the topology writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelDtype::Auto => "auto",
            ModelDtype::F32 => "f32",
            ModelDtype::Bf16 => "bf16",
            ModelDtype::F16 => "f16",
        }
    }
}

/// What `Model::path` points at, judged by its name (the crate does no I/O).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelFormat {
    /// A directory with `config.json` and safetensors files.
    HfDirectory,
    /// A file whose name ends in `.gguf`.
    Gguf,
}

/// A model the cluster serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Model {
    /// The name clients ask for.
    pub name: String,
    /// Resolved against the topology file's directory.
    pub path: PathBuf,
    pub format: ModelFormat,
    pub dtype: ModelDtype,
    /// Where `path` is written, for messages about the model's files.
    #[serde(skip)]
    pub path_at: Location,
    #[serde(skip)]
    pub(crate) index: usize,
}

/// The collective backend as written (`auto` is resolved in [`Group::collective`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveChoice {
    Auto,
    Shm,
    Tcp,
    Nccl,
}

/// How a group's cpu shards multiply activations with the weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 activations: the reference arithmetic, token for token with transformers.
    #[default]
    Exact,
    /// Activations quantized per 32-value block to 8 bits, integer dot products (Q8_0,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS weights; the
    /// float types stay exact). Ignored on cuda shards.
    Fast,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "exact" => Ok(Precision::Exact),
            "fast" => Ok(Precision::Fast),
            _ => Err(format!("`{s}` is not a precision: use `exact` or `fast`")),
        }
    }
}

/// The collective backend a group uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    /// Shared memory between CPU shards on one host.
    Shm,
    /// TCP ring between CPU shards (any hosts).
    Tcp,
    /// NCCL between CUDA shards.
    Nccl,
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Collective::Shm => "shm",
            Collective::Tcp => "tcp",
            Collective::Nccl => "nccl",
        })
    }
}

/// Where a shard computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// A GPU by index on its host, as CUDA numbers them.
    Cuda(u32),
}

impl Device {
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// One rank of a group: the process `tessera-shard`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Shard {
    pub rank: Rank,
    /// The [`Host`] it runs on.
    pub host: String,
    pub device: Device,
    /// CPU threads for compute (the whole forward pass on `cpu`, host-side work on `cuda`).
    pub threads: usize,
    /// The shard listens on its host's `address:port`.
    pub port: u16,
    /// The memory its paged KV cache may use.
    pub kv_memory_bytes: u64,
}

/// A tensor-parallel group: `tp` shards that together hold one copy of a model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Group {
    pub name: String,
    pub model: String,
    pub tp: usize,
    /// The backend in use (`auto` resolved).
    pub collective: Collective,
    /// The backend as written.
    pub requested_collective: CollectiveChoice,
    pub precision: Precision,
    /// Ordered by rank: `shards[r].rank == Rank(r)`.
    pub shards: Vec<Shard>,
    /// Where `tp` is written, for the model checks.
    #[serde(skip)]
    pub tp_at: Location,
    #[serde(skip)]
    pub(crate) index: usize,
}

impl Group {
    /// Which heads and rows each rank holds (see [`plan_group`]).
    pub fn plan(&self, shape: &ModelShape) -> Result<Vec<RankPlan>, PlanError> {
        plan_group(self.tp, shape)
    }
}

/// A validated topology file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub coordinators: Vec<CoordinatorPeer>,
    pub hosts: Vec<Host>,
    pub models: Vec<Model>,
    pub groups: Vec<Group>,
    #[serde(skip)]
    pub(crate) file: PathBuf,
    #[serde(skip)]
    pub(crate) warnings: Vec<TopologyIssue>,
}

impl Topology {
    /// Parses and validates a topology file. `path` names the file in messages, and relative
    /// paths in it resolve against its directory. On failure, returns every issue found
    /// (errors and warnings, in file order).
    pub fn parse(text: &str, path: &Path) -> Result<Topology, Vec<TopologyIssue>> {
        Topology::parse_source(&Source::new(path, text))
    }

    /// [`Topology::parse`] with an explicit base directory (see [`Source::with_base_dir`]).
    pub fn parse_source(source: &Source<'_>) -> Result<Topology, Vec<TopologyIssue>> {
        let parsed = parse::parse(source)?;
        validate::validate(&parsed.spec, source, &parsed.notes, parsed.issues)
    }

    /// Validates a spec read by other means; its spans must refer to `source`'s text.
    pub fn from_spec(
        spec: &TopologySpec,
        source: &Source<'_>,
    ) -> Result<Topology, Vec<TopologyIssue>> {
        validate::validate(spec, source, &parse::ParseNotes::default(), Vec::new())
    }

    /// The rules that need the model's shape, for every group serving `model`: tp divides
    /// the attention heads, the MLP rows and (or is a multiple of) the KV heads, and is at
    /// most the vocabulary size. Issues point at the group's `tp`. Empty when `model` is not
    /// a model of this topology.
    pub fn check_model(&self, model: &str, shape: &ModelShape) -> Vec<TopologyIssue> {
        let mut issues = Vec::new();
        for group in self.groups.iter().filter(|g| g.model == model) {
            for problem in check_tp(group.tp, shape) {
                issues.push(TopologyIssue::new(
                    Severity::Error,
                    self.file.clone(),
                    group.tp_at,
                    format!("group[{}].tp", group.index),
                    TopologyError::Plan {
                        group: group.name.clone(),
                        model: model.to_owned(),
                        problem,
                    },
                ));
            }
        }
        issues
    }

    /// An issue about a model's files (missing, unreadable), placed at its `path` key.
    pub fn model_issue(
        &self,
        model: &Model,
        severity: Severity,
        error: TopologyError,
    ) -> TopologyIssue {
        TopologyIssue::new(
            severity,
            self.file.clone(),
            model.path_at,
            format!("model[{}].path", model.index),
            error,
        )
    }

    /// Warnings found while validating (unused hosts or models, no groups).
    pub fn warnings(&self) -> &[TopologyIssue] {
        &self.warnings
    }

    /// The file this topology was read from, as given to [`Topology::parse`].
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn host(&self, name: &str) -> Option<&Host> {
        self.hosts.iter().find(|h| h.name == name)
    }

    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }

    pub fn group(&self, name: &str) -> Option<&Group> {
        self.groups.iter().find(|g| g.name == name)
    }

    /// The groups that serve `model` (replicas of it).
    pub fn groups_of<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Group> + 'a {
        self.groups.iter().filter(move |g| g.model == model)
    }
}
