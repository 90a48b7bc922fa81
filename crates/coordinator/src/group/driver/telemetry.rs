//! What a group's driver tells the world: its status for the router and the status API,
//! its Prometheus metrics, the tokens-per-second rate and the periodic step-timing report.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_comm::proto::ShardStats;
use tessera_topology::Rank;
use tracing::info;

use super::{Driver, State};
use crate::metrics as m;

/// Per-rank step timings, summed, for the periodic report.
#[derive(Default, Clone, Copy)]
pub(super) struct Totals {
    pub steps: u64,
    pub step_us: u64,
    pub collective_us: u64,
    pub idle_us: u64,
}

/// Tokens per second over the last [`RATE_WINDOW`].
#[derive(Default)]
pub(super) struct Rate {
    tokens: u64,
    since: Option<Instant>,
    per_second: f64,
}

const RATE_WINDOW: Duration = Duration::from_secs(2);

impl Rate {
    pub fn add(&mut self, tokens: usize, now: Instant) {
        self.tokens += tokens as u64;
        let since = *self.since.get_or_insert(now);
        let elapsed = now.duration_since(since);
        if elapsed >= RATE_WINDOW {
            self.per_second = self.tokens as f64 / elapsed.as_secs_f64();
            self.tokens = 0;
            self.since = Some(now);
        }
    }
}

impl Driver {
    /// A shard process's memory and GPU, as gauges labelled with its group and rank.
    pub(super) fn on_stats(&self, rank: Rank, stats: &ShardStats) {
        let labels = self.labels(rank);
        metrics::gauge!(m::SHARD_RESIDENT_BYTES, &labels).set(stats.rss_bytes as f64);
        let Some(gpu) = &stats.gpu else {
            return;
        };
        metrics::gauge!(m::GPU_UTILIZATION, &labels).set(f64::from(gpu.utilization));
        metrics::gauge!(m::GPU_MEMORY_USED, &labels).set(gpu.memory_used_bytes as f64);
        metrics::gauge!(m::GPU_MEMORY_TOTAL, &labels).set(gpu.memory_total_bytes as f64);
        metrics::gauge!(m::GPU_TEMPERATURE, &labels).set(f64::from(gpu.temperature_celsius));
        metrics::gauge!(m::GPU_POWER, &labels).set(f64::from(gpu.power_watts));
    }

    pub(super) fn labels(&self, rank: Rank) -> [(&'static str, String); 2] {
        [
            ("group", self.config.name.clone()),
            ("rank", rank.to_string()),
        ]
    }

    /// Publishes the group's state for the router, the status API and the metrics.
    pub(super) fn publish(&mut self) {
        let now = Instant::now();
        self.rate.add(0, now);
        let (used, total, block_size) = self.sched.kv_usage();
        let s = &mut self.status;
        s.state = match self.state {
            State::Down => "down",
            State::Assigning { .. } => "assigning",
            State::Serving { .. } => "serving",
        };
        s.epoch = self.epoch;
        s.running = self.sched.running();
        s.waiting = self.sched.waiting();
        s.kv_blocks = total;
        s.kv_blocks_used = used;
        s.block_size = block_size;
        s.tokens_per_second = self.rate.per_second;
        s.prefix_cache_hit_tokens = self.sched.prefix_hit_tokens();
        self.shared.waiting.store(s.waiting, Ordering::Relaxed);
        let group = || [("group", self.config.name.clone())];
        metrics::gauge!(m::SCHED_RUNNING, &group()).set(s.running as f64);
        metrics::gauge!(m::SCHED_WAITING, &group()).set(s.waiting as f64);
        metrics::gauge!(m::KV_BLOCKS_USED, &group()).set(f64::from(used));
        if total > 0 {
            let usage = f64::from(used) / f64::from(total);
            metrics::gauge!(m::KV_USAGE_RATIO, &group()).set(usage);
        }
        let serving = matches!(self.state, State::Serving { .. });
        metrics::gauge!(m::GROUP_SERVING, &group()).set(f64::from(u8::from(serving)));
        for wait in self.sched.take_queue_waits() {
            metrics::histogram!(m::SCHED_QUEUE_SECONDS, &group()).record(wait.as_secs_f64());
        }
        let preemptions = self.sched.preemptions();
        if preemptions > self.preemptions {
            metrics::counter!(m::SCHED_PREEMPTIONS, &group())
                .increment(preemptions - self.preemptions);
            self.preemptions = preemptions;
        }
        let (carried, recomputed) = self.sched.resumed();
        for (how, now, before) in [
            ("carried", carried, &mut self.resumed.0),
            ("recomputed", recomputed, &mut self.resumed.1),
        ] {
            if now > *before {
                let labels = [
                    ("group", self.config.name.clone()),
                    ("how", how.to_string()),
                ];
                metrics::counter!(m::SCHED_RESUMED, &labels).increment(now - *before);
                *before = now;
            }
        }
        *self
            .shared
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = s.clone();
    }

    /// Logs where the ranks' step time went since the last report.
    pub(super) fn report(&mut self) {
        for (r, t) in self.totals.iter_mut().enumerate() {
            if t.steps == 0 {
                continue;
            }
            let busy = t.step_us.max(1) as f64;
            info!(
                group = %self.config.name,
                rank = r,
                steps = t.steps,
                mean_step_us = t.step_us / t.steps,
                collective_share = format!("{:.3}", t.collective_us as f64 / busy),
                bubble_share = format!("{:.3}", t.idle_us as f64 / (busy + t.idle_us as f64)),
                "step timings"
            );
            *t = Totals::default();
        }
    }
}
