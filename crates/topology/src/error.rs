//! The errors of the topology file: one variant per rule. Each variant has a lowercase
//! message naming the values involved, a sentence saying what to change ([`TopologyError::change`])
//! and a stable class code ([`TopologyError::class`]) for tests, JSON output and metrics.
//!
//! [`PlanError`] is the subset that needs the model's shape (tensor-parallel divisibility);
//! it stands alone because the model loader reports it without a topology file.

use thiserror::Error;

/// Why a tensor-parallel degree cannot split a model (see [`crate::plan_group`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PlanError {
    #[error("tp = 0; tp must be at least 1")]
    TpZero,
    #[error("the model has {field} = 0")]
    EmptyShape { field: &'static str },
    #[error("num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}")]
    UngroupedHeads { heads: usize, kv_heads: usize },
    #[error("tp = {tp} does not divide num_attention_heads = {heads}")]
    Heads {
        tp: usize,
        heads: usize,
        /// Every tp that splits this model (see [`crate::fitting_tps`]).
        fits: Vec<usize>,
    },
    #[error("tp = {tp} neither divides num_key_value_heads = {kv_heads} nor is a multiple of it")]
    KvHeads {
        tp: usize,
        kv_heads: usize,
        fits: Vec<usize>,
    },
    #[error("tp = {tp} does not divide intermediate_size = {intermediate_size}")]
    MlpRows {
        tp: usize,
        intermediate_size: usize,
        fits: Vec<usize>,
    },
    #[error("tp = {tp} is larger than vocab_size = {vocab_size}")]
    VocabRows {
        tp: usize,
        vocab_size: usize,
        fits: Vec<usize>,
    },
}

impl PlanError {
    /// A stable code for this kind of problem.
    pub fn class(&self) -> &'static str {
        match self {
            PlanError::TpZero => "tp-range",
            PlanError::EmptyShape { .. } | PlanError::UngroupedHeads { .. } => "model-shape",
            PlanError::Heads { .. } => "tp-heads",
            PlanError::KvHeads { .. } => "tp-kv-heads",
            PlanError::MlpRows { .. } => "tp-mlp-rows",
            PlanError::VocabRows { .. } => "tp-vocab-rows",
        }
    }

    /// One sentence that says what to change.
    pub fn change(&self) -> String {
        match self {
            PlanError::TpZero => "set tp to at least 1".into(),
            PlanError::EmptyShape { field } => {
                format!("check the model's config: {field} must be at least 1")
            }
            PlanError::UngroupedHeads { .. } => {
                "check the model's config: each KV head must serve the same number of query heads"
                    .into()
            }
            PlanError::Heads { heads, fits, .. } => format!(
                "use a tp that divides {heads} ({}); {}",
                list(&divisors(*heads)),
                fitting(fits)
            ),
            PlanError::KvHeads { kv_heads, fits, .. } => format!(
                "use a tp that divides {kv_heads} ({}) or is a multiple of it (KV heads are then \
                 replicated); {}",
                list(&divisors(*kv_heads)),
                fitting(fits)
            ),
            PlanError::MlpRows {
                intermediate_size,
                fits,
                ..
            } => format!(
                "use a tp that divides {intermediate_size}; {}",
                fitting(fits)
            ),
            PlanError::VocabRows {
                vocab_size, fits, ..
            } => format!("use a tp of at most {vocab_size}; {}", fitting(fits)),
        }
    }
}

/// One problem in a topology file. Where it is lives in [`crate::TopologyIssue`].
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TopologyError {
    #[error("toml syntax: {message}")]
    Syntax { message: String },
    #[error("{table}: unknown key `{key}`")]
    UnknownKey {
        table: String,
        key: String,
        allowed: &'static [&'static str],
    },
    #[error("{table}: `{key}` has an invalid value: {message}")]
    InvalidValue {
        table: String,
        key: String,
        message: String,
    },
    #[error("{table}: {message}")]
    InvalidEntry { table: String, message: String },
    #[error("`{key}` must be an array of tables")]
    NotArrayOfTables { key: String },
    #[error("{table}: missing key `{key}`")]
    MissingKey { table: String, key: &'static str },
    #[error("{what}: {key} = {value:?} is not a valid name: {reason}")]
    BadName {
        what: String,
        key: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("{kind} name `{name}` is used twice (first at line {first_line})")]
    DuplicateName {
        kind: &'static str,
        name: String,
        first_line: usize,
    },
    #[error("{count} coordinator peers; raft needs 1, 3 or 5")]
    CoordinatorCount { count: usize },
    #[error("coordinator id = {id}; ids must be at least 1")]
    PeerIdRange { id: i64 },
    #[error("coordinator id {id} is used twice (first at line {first_line})")]
    DuplicatePeerId { id: u64, first_line: usize },
    #[error("{what}: {key} = {value:?} is not a valid address: {reason}")]
    BadAddress {
        what: String,
        key: &'static str,
        value: String,
        reason: String,
    },
    #[error("{what}: quic = {value:?} is a wildcard address, which other peers cannot dial")]
    WildcardQuic { what: String, value: String },
    #[error("host {host}: port {port} is used by both {first} and {second}")]
    PortCollision {
        host: String,
        port: u16,
        first: String,
        second: String,
    },
    #[error("host {host}: coordinators {first} and {second} share data_dir {dir}")]
    SharedDataDir {
        host: String,
        dir: String,
        first: u64,
        second: u64,
    },
    #[error("{what}: host `{name}` is not defined")]
    UnknownHost {
        what: String,
        name: String,
        known: Vec<String>,
    },
    #[error("host {name} runs no coordinator and no shard")]
    UnusedHost { name: String },
    #[error("model {model}: dtype = {value:?} is not one of auto, f32, bf16, f16")]
    BadDtype { model: String, value: String },
    #[error("model {model}: path is empty")]
    EmptyPath { model: String },
    #[error("group {group}: model `{name}` is not defined")]
    UnknownModel {
        group: String,
        name: String,
        known: Vec<String>,
    },
    #[error("model {name} is not served by any group")]
    UnusedModel { name: String },
    #[error("no [[group]] entries: the cluster serves no model")]
    NoGroups,
    #[error("group {group}: tp = {tp}; tp must be at least 1")]
    TpRange { group: String, tp: i64 },
    #[error("group {group}: tp = {tp} but the group has {shards} [[group.shard]] entries")]
    ShardCount {
        group: String,
        tp: usize,
        shards: usize,
        missing: Vec<usize>,
    },
    #[error("group {group}: rank {rank} is outside 0..{tp}")]
    RankRange { group: String, rank: i64, tp: usize },
    #[error("group {group}: rank {rank} appears twice (first at line {first_line})")]
    DuplicateRank {
        group: String,
        rank: i64,
        first_line: usize,
    },
    #[error("group {group}: collective = {value:?} is not one of auto, shm, tcp, nccl")]
    BadCollective { group: String, value: String },
    #[error("group {group}: precision = {value:?} is not one of exact, fast")]
    BadPrecision { group: String, value: String },
    #[error("{what}: device = {value:?} is not a device: {reason}")]
    BadDevice {
        what: String,
        value: String,
        reason: String,
    },
    #[error(
        "group {group}: mixes cpu and cuda devices (rank {cpu_rank} is cpu, rank {cuda_rank} is cuda)"
    )]
    MixedDevices {
        group: String,
        cpu_rank: u32,
        cuda_rank: u32,
    },
    #[error("host {host}: {device} is used by both {first} and {second}")]
    SharedCudaDevice {
        host: String,
        device: String,
        first: String,
        second: String,
    },
    #[error("group {group}: collective = \"nccl\" needs cuda devices, but the shards run on cpu")]
    NcclOnCpu { group: String },
    #[error(
        "group {group}: model `{model}` has dtype = \"{dtype}\", which cuda shards cannot hold \
         (on a GPU weights are bf16, with the quantized types the device reads kept quantized, or \
         f32)"
    )]
    DtypeOnCuda {
        group: String,
        model: String,
        dtype: String,
    },
    #[error("group {group}: collective = \"shm\" needs every rank on one host, but they run on {}", hosts.join(", "))]
    ShmAcrossHosts { group: String, hosts: Vec<String> },
    #[error("{what}: threads = {threads}; threads must be at least 1")]
    ThreadsRange { what: String, threads: i64 },
    #[error("{what}: port = {port} is outside 1..=65535")]
    PortRange { what: String, port: i64 },
    #[error("{what}: kv_memory = {value} is not a size: {reason}")]
    BadSize {
        what: String,
        value: String,
        reason: String,
    },
    #[error("{what}: kv_memory is 0 bytes")]
    ZeroKvMemory { what: String },
    #[error("group {group} (model {model}): {problem}")]
    Plan {
        group: String,
        model: String,
        problem: PlanError,
    },
    #[error("model {model}: {path} does not exist; the checks that need its config were skipped")]
    ModelMissing { model: String, path: String },
    #[error("model {model}: cannot read its config: {reason}")]
    ModelConfig { model: String, reason: String },
}

impl TopologyError {
    /// A stable code for this kind of problem (kebab-case; never renamed).
    pub fn class(&self) -> &'static str {
        use TopologyError as E;
        match self {
            E::Syntax { .. } => "syntax",
            E::UnknownKey { .. } => "unknown-key",
            E::InvalidValue { .. } => "invalid-value",
            E::InvalidEntry { .. } => "invalid-entry",
            E::NotArrayOfTables { .. } => "not-array-of-tables",
            E::MissingKey { .. } => "missing-key",
            E::BadName { .. } => "bad-name",
            E::DuplicateName { .. } => "duplicate-name",
            E::CoordinatorCount { .. } => "coordinator-count",
            E::PeerIdRange { .. } => "peer-id-range",
            E::DuplicatePeerId { .. } => "duplicate-peer-id",
            E::BadAddress { .. } => "bad-address",
            E::WildcardQuic { .. } => "wildcard-quic",
            E::PortCollision { .. } => "port-collision",
            E::SharedDataDir { .. } => "shared-data-dir",
            E::UnknownHost { .. } => "unknown-host",
            E::UnusedHost { .. } => "unused-host",
            E::BadDtype { .. } => "bad-dtype",
            E::EmptyPath { .. } => "empty-path",
            E::UnknownModel { .. } => "unknown-model",
            E::UnusedModel { .. } => "unused-model",
            E::NoGroups => "no-groups",
            E::TpRange { .. } => "tp-range",
            E::ShardCount { .. } => "shard-count",
            E::RankRange { .. } => "rank-range",
            E::DuplicateRank { .. } => "duplicate-rank",
            E::BadCollective { .. } => "bad-collective",
            E::BadPrecision { .. } => "bad-precision",
            E::BadDevice { .. } => "bad-device",
            E::MixedDevices { .. } => "mixed-devices",
            E::SharedCudaDevice { .. } => "shared-cuda-device",
            E::NcclOnCpu { .. } => "collective-device",
            E::DtypeOnCuda { .. } => "dtype-device",
            E::ShmAcrossHosts { .. } => "shm-across-hosts",
            E::ThreadsRange { .. } => "threads-range",
            E::PortRange { .. } => "port-range",
            E::BadSize { .. } => "bad-size",
            E::ZeroKvMemory { .. } => "zero-kv-memory",
            E::Plan { problem, .. } => problem.class(),
            E::ModelMissing { .. } => "model-missing",
            E::ModelConfig { .. } => "model-config",
        }
    }

    /// One sentence that says what to change in the file.
    pub fn change(&self) -> String {
        use TopologyError as E;
        match self {
            E::Syntax { .. } => {
                "fix the TOML syntax here: strings need quotes, and a key appears once per table"
                    .into()
            }
            E::UnknownKey { key, allowed, .. } => {
                format!(
                    "remove `{key}` or rename it to one of: {}",
                    allowed.join(", ")
                )
            }
            E::InvalidValue { key, .. } => format!("write it like {key} = {}", example(key)),
            E::InvalidEntry { .. } => {
                "write each entry as a table of keys under its [[...]] header".into()
            }
            E::NotArrayOfTables { key } => {
                format!("write each entry under its own [[{key}]] header")
            }
            E::MissingKey { key, .. } => format!("add {key} = {}", example(key)),
            E::BadName { key, .. } => {
                format!("write {key} without spaces, quotes or control characters")
            }
            E::DuplicateName { kind, .. } => format!("give every {kind} a different name"),
            E::CoordinatorCount { count: 0 } => {
                "add a [[coordinator]] entry with id, host, quic and http".into()
            }
            E::CoordinatorCount { .. } => {
                "use 1, 3 or 5 [[coordinator]] entries: n peers survive (n - 1) / 2 failures, \
                 so an even count adds no tolerance"
                    .into()
            }
            E::PeerIdRange { .. } => "use ids 1, 2, 3, ... (raft reserves 0)".into(),
            E::DuplicatePeerId { .. } => "give every [[coordinator]] a different id".into(),
            E::BadAddress { key, .. } => address_change(key),
            E::WildcardQuic { .. } => {
                "use the address the other peers reach this one at, e.g. the host's address".into()
            }
            E::PortCollision { host, second, .. } => {
                format!("give {second} a port that nothing else on host {host} listens on")
            }
            E::SharedDataDir { second, .. } => {
                format!("give coordinator {second} a data_dir of its own")
            }
            E::UnknownHost { name, known, .. } => format!(
                "define it with a [[host]] entry (name = {name:?}, address = ...){}",
                one_of(known)
            ),
            E::UnusedHost { .. } => "remove the [[host]] entry or place a shard on it".into(),
            E::BadDtype { .. } => {
                "set dtype to \"auto\" (the type stored in the file), \"f32\", \"bf16\" or \"f16\""
                    .into()
            }
            E::EmptyPath { .. } => {
                "set path to a HuggingFace model directory or a .gguf file".into()
            }
            E::UnknownModel { known, .. } => {
                format!("define it with a [[model]] entry{}", one_of(known))
            }
            E::UnusedModel { name } => {
                format!("add a [[group]] with model = {name:?}, or remove the [[model]] entry")
            }
            E::NoGroups => "add a [[group]] with one [[group.shard]] entry per rank".into(),
            E::TpRange { .. } => {
                "set tp to the number of ranks (1 for no tensor parallelism)".into()
            }
            E::ShardCount { tp, missing, .. } => shard_count_change(*tp, missing),
            E::RankRange { tp, .. } => {
                format!(
                    "number the shards 0 to {}, or raise tp",
                    tp.saturating_sub(1)
                )
            }
            E::DuplicateRank { .. } => "give every shard of the group a different rank".into(),
            E::BadCollective { .. } => {
                "set collective to \"auto\" (shm on one host, tcp across hosts, nccl on cuda), \
                 \"shm\", \"tcp\" or \"nccl\""
                    .into()
            }
            E::BadPrecision { .. } => {
                "set precision to \"exact\" (f32 activations, the reference) or \"fast\" \
                 (8-bit activations on cpu shards)"
                    .into()
            }
            E::BadDevice { .. } => "write \"cpu\" or \"cuda:N\" with N the GPU index".into(),
            E::DtypeOnCuda { .. } => {
                "set the model's dtype to \"auto\", \"bf16\" or \"f32\" (the exact path), or run \
                 the group on cpu devices"
                    .into()
            }
            E::MixedDevices { .. } => {
                "run every rank of a group on one kind of device; make another group for the \
                 other kind"
                    .into()
            }
            E::SharedCudaDevice { second, .. } => {
                format!(
                    "give {second} a GPU of its own: one shard per GPU (ranks of groups with \
                     collective = \"shm\" or \"tcp\" may share one, for tests)"
                )
            }
            E::NcclOnCpu { .. } => {
                "use collective = \"auto\", \"shm\" (one host) or \"tcp\" for cpu shards".into()
            }
            E::ShmAcrossHosts { .. } => {
                "use collective = \"tcp\" (or \"auto\"), or place every rank on one host".into()
            }
            E::ThreadsRange { .. } => {
                "set threads to the number of CPU cores this shard may use (at least 1)".into()
            }
            E::PortRange { .. } => "choose a free port between 1024 and 65535".into(),
            E::BadSize { .. } => {
                "write a size with a binary unit, e.g. \"512MiB\" or \"2GiB\", or a number of bytes"
                    .into()
            }
            E::ZeroKvMemory { .. } => "give the shard a KV budget above 0, e.g. \"1GiB\"".into(),
            E::Plan { problem, .. } => {
                format!("{}, with one [[group.shard]] per rank", problem.change())
            }
            E::ModelMissing { .. } => {
                "fetch the model to that path, or fix path (relative paths start at the \
                 topology file's directory)"
                    .into()
            }
            E::ModelConfig { .. } => {
                "point path at a HuggingFace directory with config.json or at a .gguf file".into()
            }
        }
    }
}

/// An example value for a key of the topology file, used in "what to change" sentences.
pub(crate) fn example(key: &str) -> &'static str {
    match key {
        "id" => "1",
        "host" => "\"node-a\"",
        "quic" => "\"10.0.0.1:7000\"",
        "http" => "\"10.0.0.1:8000\"",
        "data_dir" => "\"run/coordinator-1\"",
        "name" => "\"node-a\"",
        "address" => "\"10.0.0.1\"",
        "path" => "\"models/Llama-3-8B\"",
        "dtype" => "\"auto\"",
        "model" => "\"llama\"",
        "tp" => "2",
        "collective" => "\"auto\"",
        "rank" => "0",
        "device" => "\"cuda:0\"",
        "threads" => "4",
        "port" => "7100",
        "kv_memory" => "\"2GiB\"",
        _ => "a value of the documented type",
    }
}

fn address_change(key: &str) -> String {
    if key == "address" {
        "write an IP address or DNS name without a port, e.g. \"10.0.0.1\"".into()
    } else {
        format!(
            "write it as ip:port or name:port, e.g. {key} = {} ([::1]:8000 for IPv6)",
            example(key)
        )
    }
}

fn shard_count_change(tp: usize, missing: &[usize]) -> String {
    let last = tp.saturating_sub(1);
    if missing.is_empty() {
        format!("give the group exactly {tp} [[group.shard]] entries, ranks 0 to {last}")
    } else {
        format!(
            "give the group exactly {tp} [[group.shard]] entries, ranks 0 to {last} (missing: {})",
            list(missing)
        )
    }
}

fn one_of(known: &[String]) -> String {
    if known.is_empty() {
        String::new()
    } else {
        format!(", or use one of: {}", known.join(", "))
    }
}

fn fitting(fits: &[usize]) -> String {
    if fits.is_empty() {
        "no tp splits this model".into()
    } else {
        format!("tp values that split this model: {}", list(fits))
    }
}

fn list(values: &[usize]) -> String {
    let parts: Vec<String> = values.iter().map(usize::to_string).collect();
    parts.join(", ")
}

/// The divisors of `n` in increasing order (empty for 0).
pub(crate) fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_message_and_change_name_the_values() {
        let e = TopologyError::Plan {
            group: "g0".into(),
            model: "llama".into(),
            problem: PlanError::Heads {
                tp: 3,
                heads: 32,
                fits: vec![1, 2, 4, 8],
            },
        };
        assert_eq!(
            e.to_string(),
            "group g0 (model llama): tp = 3 does not divide num_attention_heads = 32"
        );
        assert_eq!(
            e.change(),
            "use a tp that divides 32 (1, 2, 4, 8, 16, 32); tp values that split this model: \
             1, 2, 4, 8, with one [[group.shard]] per rank"
        );
        assert_eq!(e.class(), "tp-heads");
    }

    #[test]
    fn divisors_are_complete_and_sorted() {
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(1), vec![1]);
        assert!(divisors(0).is_empty());
    }

    #[test]
    fn shard_count_change_lists_missing_ranks() {
        let e = TopologyError::ShardCount {
            group: "g".into(),
            tp: 4,
            shards: 2,
            missing: vec![2, 3],
        };
        assert!(
            e.change().ends_with("ranks 0 to 3 (missing: 2, 3)"),
            "{}",
            e.change()
        );
    }
}
