//! The statistics of a run: percentiles of a sample and the run's summary, computed from
//! the per-request results. Pure: no clock, no I/O; the driver hands it durations.

use std::time::Duration;

use serde::Serialize;

/// Mean, extremes and percentiles of one latency metric, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Distribution {
    /// How many values the sample held.
    pub count: usize,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Distribution {
    /// The distribution of `values` (seconds), or `None` for an empty sample.
    pub fn of_seconds(values: &[f64]) -> Option<Self> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let ms = |s: f64| s * 1e3;
        Some(Self {
            count: sorted.len(),
            mean_ms: ms(sorted.iter().sum::<f64>() / sorted.len() as f64),
            min_ms: ms(sorted[0]),
            p50_ms: ms(percentile(&sorted, 50.0)),
            p90_ms: ms(percentile(&sorted, 90.0)),
            p99_ms: ms(percentile(&sorted, 99.0)),
            max_ms: ms(sorted[sorted.len() - 1]),
        })
    }

    /// The distribution of `durations`.
    pub fn of(durations: &[Duration]) -> Option<Self> {
        let seconds: Vec<f64> = durations.iter().map(Duration::as_secs_f64).collect();
        Self::of_seconds(&seconds)
    }
}

/// The `q`-th percentile (0–100) of `sorted` (ascending, not empty), interpolating
/// linearly between the two closest ranks: rank `q / 100 · (n − 1)`, numpy's default
/// ("linear"), so numbers compare with Python benchmark scripts.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    debug_assert!(!sorted.is_empty());
    let rank = (q / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let low = rank.floor() as usize;
    let high = rank.ceil() as usize;
    let fraction = rank - low as f64;
    sorted[low] + (sorted[high] - sorted[low]) * fraction
}

/// One finished request, as the statistics need it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestTimings {
    /// From sending the request to the first content token (streaming only).
    pub ttft: Option<Duration>,
    /// Gaps between content tokens (streaming only; see `client` for chunks of several).
    pub itls: Vec<Duration>,
    /// From sending the request to the end of the answer.
    pub e2e: Duration,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl RequestTimings {
    /// Time per output token after the first: `(e2e − ttft) / (completion_tokens − 1)`;
    /// `None` without a TTFT or with fewer than two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let after_first = u32::try_from(self.completion_tokens.checked_sub(1)?).ok()?;
        if after_first == 0 {
            return None;
        }
        Some(self.e2e.saturating_sub(ttft) / after_first)
    }
}

/// The numbers of a run over its successful requests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub completed: usize,
    pub prompt_tokens_total: usize,
    pub completion_tokens_total: usize,
    pub request_throughput_per_s: f64,
    pub output_token_throughput_per_s: f64,
    pub total_token_throughput_per_s: f64,
    pub ttft: Option<Distribution>,
    pub itl: Option<Distribution>,
    pub tpot: Option<Distribution>,
    pub e2e: Option<Distribution>,
}

impl Summary {
    /// Summarises `requests`, which finished within `wall` (the measured phase's length).
    pub fn of(requests: &[RequestTimings], wall: Duration) -> Self {
        let ttfts: Vec<Duration> = requests.iter().filter_map(|r| r.ttft).collect();
        let itls: Vec<Duration> = requests
            .iter()
            .flat_map(|r| r.itls.iter().copied())
            .collect();
        let tpots: Vec<Duration> = requests.iter().filter_map(RequestTimings::tpot).collect();
        let e2es: Vec<Duration> = requests.iter().map(|r| r.e2e).collect();
        let prompt_tokens_total = requests.iter().map(|r| r.prompt_tokens).sum();
        let completion_tokens_total: usize = requests.iter().map(|r| r.completion_tokens).sum();
        let per_s = |n: usize| {
            let wall_s = wall.as_secs_f64();
            if wall_s > 0.0 { n as f64 / wall_s } else { 0.0 }
        };
        Self {
            completed: requests.len(),
            prompt_tokens_total,
            completion_tokens_total,
            request_throughput_per_s: per_s(requests.len()),
            output_token_throughput_per_s: per_s(completion_tokens_total),
            total_token_throughput_per_s: per_s(prompt_tokens_total + completion_tokens_total),
            ttft: Distribution::of(&ttfts),
            itl: Distribution::of(&itls),
            tpot: Distribution::of(&tpots),
            e2e: Distribution::of(&e2es),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let sorted = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        // rank = q/100 · 9: p50 → 4.5 → 5.5; p90 → 8.1 → 9.1; p99 → 8.91 → 9.91.
        assert!(close(percentile(&sorted, 50.0), 5.5));
        assert!(close(percentile(&sorted, 90.0), 9.1));
        assert!(close(percentile(&sorted, 99.0), 9.91));
        assert!(close(percentile(&sorted, 0.0), 1.0));
        assert!(close(percentile(&sorted, 100.0), 10.0));
        assert!(close(percentile(&[7.0], 99.0), 7.0));
        // Uneven values: [10, 20, 40, 80], p50 → rank 1.5 → 30; p90 → rank 2.7 → 40 + 0.7·40.
        assert!(close(percentile(&[10.0, 20.0, 40.0, 80.0], 50.0), 30.0));
        assert!(close(percentile(&[10.0, 20.0, 40.0, 80.0], 90.0), 68.0));
    }

    #[test]
    fn distributions_sort_and_convert_to_milliseconds() {
        let d = Distribution::of_seconds(&[0.004, 0.001, 0.003, 0.002]).expect("not empty");
        assert_eq!(d.count, 4);
        assert!(close(d.mean_ms, 2.5));
        assert!(close(d.min_ms, 1.0));
        assert!(close(d.p50_ms, 2.5));
        // rank 0.9 · 3 = 2.7 → 3 + 0.7.
        assert!(close(d.p90_ms, 3.7));
        assert!(close(d.max_ms, 4.0));
        assert_eq!(Distribution::of_seconds(&[]), None);
        assert_eq!(Distribution::of_seconds(&[f64::NAN]), None);
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        let r = RequestTimings {
            ttft: Some(Duration::from_millis(100)),
            e2e: Duration::from_millis(500),
            completion_tokens: 5,
            ..RequestTimings::default()
        };
        assert_eq!(r.tpot(), Some(Duration::from_millis(100)));
        let one = RequestTimings {
            completion_tokens: 1,
            ..r.clone()
        };
        assert_eq!(one.tpot(), None);
        let unstreamed = RequestTimings { ttft: None, ..r };
        assert_eq!(unstreamed.tpot(), None);
    }

    #[test]
    fn summary_counts_tokens_over_the_wall_time() {
        let ms = Duration::from_millis;
        let requests = vec![
            RequestTimings {
                ttft: Some(ms(10)),
                itls: vec![ms(20), ms(30)],
                e2e: ms(60),
                prompt_tokens: 8,
                completion_tokens: 3,
            },
            RequestTimings {
                ttft: Some(ms(30)),
                itls: vec![ms(40)],
                e2e: ms(70),
                prompt_tokens: 12,
                completion_tokens: 2,
            },
        ];
        let s = Summary::of(&requests, Duration::from_secs(2));
        assert_eq!(s.completed, 2);
        assert_eq!(s.prompt_tokens_total, 20);
        assert_eq!(s.completion_tokens_total, 5);
        assert!(close(s.request_throughput_per_s, 1.0));
        assert!(close(s.output_token_throughput_per_s, 2.5));
        assert!(close(s.total_token_throughput_per_s, 12.5));
        let ttft = s.ttft.expect("ttft");
        assert!(close(ttft.mean_ms, 20.0));
        let itl = s.itl.expect("itl");
        assert_eq!(itl.count, 3);
        assert!(close(itl.p50_ms, 30.0));
        // TPOTs: (60 − 10) / 2 = 25 ms and (70 − 30) / 1 = 40 ms.
        let tpot = s.tpot.expect("tpot");
        assert!(close(tpot.mean_ms, 32.5));
        assert!(close(s.e2e.expect("e2e").max_ms, 70.0));
        let empty = Summary::of(&[], Duration::ZERO);
        assert_eq!(empty.ttft, None);
        assert!(close(empty.request_throughput_per_s, 0.0));
    }
}
