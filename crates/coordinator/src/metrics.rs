//! The coordinator's Prometheus metrics: names (constants, `tessera_<area>_<name>_<unit>`),
//! and the recorder that `GET /metrics` renders. Labels are group and rank names, routes and
//! status codes only.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Bytes of weights a rank read from the model files for its slice (gauge).
pub const SHARD_WEIGHT_BYTES: &str = "tessera_shard_weight_bytes";
/// KV blocks a rank reported for the current epoch (gauge).
pub const SHARD_KV_BLOCKS: &str = "tessera_shard_kv_blocks";
/// Time a rank spent executing one step (histogram).
pub const SHARD_STEP_SECONDS: &str = "tessera_shard_step_duration_seconds";
/// Time inside collective calls during one step (histogram).
pub const SHARD_COLLECTIVE_SECONDS: &str = "tessera_shard_collective_seconds";
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
/// KV blocks rank 0 reported allocatable (free or cached-unreferenced) (gauge).
pub const KV_BLOCKS_FREE: &str = "tessera_kv_blocks_free";
/// Prompt tokens served from the shards' prefix cache (counter).
pub const PREFIX_CACHE_HIT_TOKENS: &str = "tessera_prefix_cache_hit_tokens_total";
/// Tokens computed per step (prompt chunks + decodes) (histogram).
pub const STEP_TOKENS: &str = "tessera_scheduler_step_tokens";

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

/// Installs the process-wide recorder; `None` if one is already installed (a second
/// coordinator in one test process).
pub fn install() -> Option<PrometheusHandle> {
    PrometheusBuilder::new().install_recorder().ok()
}
