//! The coordinator's Prometheus metrics: names (constants, `tessera_<area>_<name>_<unit>`),
//! the recorder that `GET /metrics` renders (histograms with buckets, so that peers'
//! series add up), and the tasks that export the process's and the Raft peer's state.
//! Labels are group, rank and model names, routes and status codes only. `docs/metrics.md` lists
//! them, with the vLLM metric each matches.

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::replication::node::NodeHandle;

/// Bytes of weights a rank read from the model files for its slice (gauge).
pub const SHARD_WEIGHT_BYTES: &str = "tessera_shard_weight_bytes";
/// KV blocks a rank reported for the current epoch (gauge).
pub const SHARD_KV_BLOCKS: &str = "tessera_shard_kv_blocks";
/// Seconds a shard's last warmup took (gauge; `group`, `rank`).
pub const SHARD_WARMUP_SECONDS: &str = "tessera_shard_warmup_seconds";
/// Time a rank spent executing one step (histogram).
pub const SHARD_STEP_SECONDS: &str = "tessera_shard_step_duration_seconds";
/// Time inside collective calls during one step (histogram).
pub const SHARD_COLLECTIVE_SECONDS: &str = "tessera_shard_collective_seconds";
/// Payload bytes a rank sent into collective calls (counter).
pub const SHARD_COLLECTIVE_BYTES: &str = "tessera_shard_collective_bytes_total";
/// Resident memory of a shard process (gauge; sent every 5 s).
pub const SHARD_RESIDENT_BYTES: &str = "tessera_shard_resident_memory_bytes";
/// A shard's GPU through NVML, whole-device figures (gauges; absent without NVML):
/// the share of time a kernel ran, 0 to 1,
pub const GPU_UTILIZATION: &str = "tessera_gpu_utilization_ratio";
/// device memory in use (every process on the GPU counts),
pub const GPU_MEMORY_USED: &str = "tessera_gpu_memory_used_bytes";
/// device memory in all,
pub const GPU_MEMORY_TOTAL: &str = "tessera_gpu_memory_total_bytes";
/// the GPU's temperature,
pub const GPU_TEMPERATURE: &str = "tessera_gpu_temperature_celsius";
/// and its power draw.
pub const GPU_POWER: &str = "tessera_gpu_power_watts";
/// Time a rank waited for its next plan after finishing a step: the bubble (histogram).
pub const SHARD_IDLE_SECONDS: &str = "tessera_shard_idle_seconds";
/// Epochs ended by a failure (counter).
pub const GROUP_FENCES: &str = "tessera_group_fences_total";
/// The group's current epoch (gauge).
pub const GROUP_EPOCH: &str = "tessera_group_epoch";
/// Sequences with KV on the group's shards (gauge).
pub const SCHED_RUNNING: &str = "tessera_scheduler_running_sequences";
/// Requests waiting for admission (gauge).
pub const SCHED_WAITING: &str = "tessera_scheduler_waiting_sequences";
/// Sequences preempted (freed, to be recomputed) for lack of KV blocks (counter).
pub const SCHED_PREEMPTIONS: &str = "tessera_scheduler_preemptions_total";
/// Journaled requests a new leader resumed, by how: `carried` (the shards still held the
/// sequence's KV: no recompute) or `recomputed` (prefill of prompt + tokens sent) (counter).
pub const SCHED_RESUMED: &str = "tessera_scheduler_resumed_sequences_total";
/// Requests refused because the waiting queue was full (counter).
pub const SCHED_REJECTED: &str = "tessera_scheduler_rejected_total";
/// KV blocks counted in use by the scheduler, per group (gauge).
pub const KV_BLOCKS_USED: &str = "tessera_kv_blocks_used";
/// The share of the group's KV blocks in use, 0 to 1 (gauge).
pub const KV_USAGE_RATIO: &str = "tessera_kv_usage_ratio";
/// 1 while the group serves (its epoch's shards are all ready), else 0 (gauge).
pub const GROUP_SERVING: &str = "tessera_group_serving";
/// From a request's arrival in a group's queue to its first step (histogram).
pub const SCHED_QUEUE_SECONDS: &str = "tessera_scheduler_queue_time_seconds";
/// KV blocks rank 0 reported allocatable (free or cached-unreferenced) (gauge).
pub const KV_BLOCKS_FREE: &str = "tessera_kv_blocks_free";
/// Prompt tokens served from the shards' prefix cache (counter).
pub const PREFIX_CACHE_HIT_TOKENS: &str = "tessera_prefix_cache_hit_tokens_total";
/// Tokens computed per step (prompt chunks + decodes) (histogram).
pub const STEP_TOKENS: &str = "tessera_scheduler_step_tokens";

/// A model's stable version, and its canary's (gauges; `model`, `role`: stable, canary;
/// the canary's is 0 without one).
pub const MODEL_VERSION: &str = "tessera_model_version";
/// The share of a model's requests its canary gets, 0 to 100 (gauge; `model`).
pub const MODEL_CANARY_PERCENT: &str = "tessera_model_canary_percent";
/// Rollbacks of a model's version, by `cause`: automatic (a failing canary) or manual
/// (counter).
pub const MODEL_ROLLBACKS: &str = "tessera_model_rollbacks_total";
/// The generation of the topology this peer follows: 0 for its file, then one more for
/// each topology applied (gauge).
pub const TOPOLOGY_GENERATION: &str = "tessera_topology_generation";

/// Requests in the replicated journal, open or finished (gauge).
pub const JOURNAL_ENTRIES: &str = "tessera_journal_entries";
/// Requests in the journal not finished yet (gauge).
pub const JOURNAL_OPEN_ENTRIES: &str = "tessera_journal_open_entries";
/// Bytes the journal counts, an open request at its largest (gauge).
pub const JOURNAL_BYTES: &str = "tessera_journal_bytes";
/// The journal's budget (gauge).
pub const JOURNAL_BUDGET_BYTES: &str = "tessera_journal_budget_bytes";
/// Requests refused because open requests filled the journal's budget (counter).
pub const JOURNAL_REFUSED: &str = "tessera_journal_refused_total";

/// From accepting a request to its first sampled token, per choice (histogram).
pub const API_TIME_TO_FIRST_TOKEN_SECONDS: &str = "tessera_api_time_to_first_token_seconds";
/// Between two tokens of one choice (histogram).
pub const API_INTER_TOKEN_LATENCY_SECONDS: &str = "tessera_api_inter_token_latency_seconds";
/// From accepting a request to its last token, for requests that ran to their end
/// (histogram).
pub const API_REQUEST_DURATION_SECONDS: &str = "tessera_api_request_duration_seconds";
/// Prompt tokens of requests that ran to their end (counter).
pub const API_PROMPT_TOKENS: &str = "tessera_api_prompt_tokens_total";
/// Tokens generated for requests that ran to their end, every choice (counter).
pub const API_GENERATED_TOKENS: &str = "tessera_api_generated_tokens_total";
/// HTTP requests by route (the matched pattern) and status code (counter).
pub const API_REQUESTS: &str = "tessera_api_requests_total";
/// Inference requests being served (counted by the API's limits).
pub const API_IN_FLIGHT: &str = "tessera_api_in_flight_requests";
/// Requests shed by the API's limits, by `reason` (in_flight, key_in_flight, rate, and
/// draining: refused while the peer drains).
pub const API_SHED: &str = "tessera_api_shed_total";
/// Connections closed because their client stopped reading (a stream's sequence is
/// cancelled with it).
pub const API_WRITE_TIMEOUTS: &str = "tessera_api_write_timeouts_total";
/// Connections refused at the connection limit.
pub const API_CONNECTIONS_REFUSED: &str = "tessera_api_connections_refused_total";
/// HTTP connections open.
pub const API_CONNECTIONS: &str = "tessera_api_connections";
/// 1 while this peer drains before it stops (`POST /v1/admin/drain`, SIGTERM).
pub const API_DRAINING: &str = "tessera_api_draining";

/// The Raft term this peer knows (gauge).
pub const RAFT_TERM: &str = "tessera_raft_term";
/// 1 while this peer knows a leader, else 0 (gauge).
pub const RAFT_HAS_LEADER: &str = "tessera_raft_has_leader";
/// 1 while this peer leads, else 0 (gauge).
pub const RAFT_IS_LEADER: &str = "tessera_raft_is_leader";
/// From proposing a command to applying it on this peer: the commit latency (histogram).
pub const RAFT_PROPOSAL_SECONDS: &str = "tessera_raft_proposal_seconds";
/// The process's resident memory (gauge; the Prometheus convention's name).
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
/// File descriptors the process holds open (gauge).
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";

/// Latency buckets, in seconds, from 1 ms to 10 min.
const SECONDS_BUCKETS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0, 600.0,
];

/// Tokens per step, 1 to 16384.
const TOKEN_BUCKETS: [f64; 15] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0,
];

/// Installs the process-wide recorder; `None` if one is already installed (a second
/// coordinator in one test process). Every histogram gets buckets.
pub fn install() -> Option<PrometheusHandle> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(STEP_TOKENS.into()), &TOKEN_BUCKETS))
        .ok()?;
    builder.install_recorder().ok()
}

/// How often the process's and the Raft peer's gauges are refreshed.
const EXPORT_EVERY: Duration = Duration::from_secs(5);

/// Keeps the Raft gauges current: the term, whether a leader is known, whether this peer
/// leads. Runs until the peer stops.
pub async fn export_raft(node: NodeHandle) {
    let mut role = node.role();
    loop {
        let now = *role.borrow_and_update();
        ::metrics::gauge!(RAFT_TERM).set(now.term.0 as f64);
        ::metrics::gauge!(RAFT_HAS_LEADER).set(f64::from(u8::from(now.leader.is_some())));
        ::metrics::gauge!(RAFT_IS_LEADER).set(f64::from(u8::from(now.is_leader())));
        if role.changed().await.is_err() {
            return;
        }
    }
}

/// Refreshes the process gauges every [`EXPORT_EVERY`], for ever.
pub async fn export_process() {
    let mut every = tokio::time::interval(EXPORT_EVERY);
    loop {
        every.tick().await;
        if let Some(rss) = resident_bytes() {
            ::metrics::gauge!(PROCESS_RESIDENT_MEMORY_BYTES).set(rss as f64);
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            ::metrics::gauge!(PROCESS_OPEN_FDS).set(fds.count() as f64);
        }
    }
}

/// Resident bytes, from `/proc/self/statm` (pages, second field); `None` off Linux.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * rustix::param::page_size() as u64)
}
