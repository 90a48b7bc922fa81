//! Judging a canary: every new request's end (failed or not) and time to first token,
//! counted per model version as the groups see them ([`Outcomes`]), and the verdict over
//! a window ([`judge`]), a pure function the leader calls every second
//! (`crate::leader::rollout`).
//!
//! A canary is rolled back when, over the window, its error rate passes the limit (1% by
//! default), or its TTFT p99 passes a multiple (1.5× by default) of the stable version's.
//! Either needs `min_requests` of the canary's requests in the window, so that one early
//! failure out of three is not a verdict; the TTFT rule also needs as many of the stable
//! version's.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The samples kept per version: enough for a p99 over a busy window, bounded.
const MAX_SAMPLES: usize = 8192;

/// One request's end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub at: Instant,
    pub failed: bool,
    /// `None` when it failed before its first token.
    pub ttft: Option<Duration>,
}

/// Every version's recent samples, shared by the groups that record them and the leader
/// that judges them.
#[derive(Debug, Default)]
pub struct Outcomes {
    samples: Mutex<BTreeMap<(String, u32), VecDeque<Sample>>>,
}

impl Outcomes {
    pub fn record(&self, model: &str, version: u32, failed: bool, ttft: Option<Duration>) {
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let kept = samples.entry((model.to_string(), version)).or_default();
        if kept.len() == MAX_SAMPLES {
            kept.pop_front();
        }
        kept.push_back(Sample {
            at: Instant::now(),
            failed,
            ttft,
        });
    }

    /// The samples of `model` version `version` since `since`, oldest first.
    pub fn since(&self, model: &str, version: u32, since: Instant) -> Vec<Sample> {
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(kept) = samples.get(&(model.to_string(), version)) else {
            return Vec::new();
        };
        kept.iter().filter(|s| s.at >= since).copied().collect()
    }

    /// Forgets every version of `model` but those in `keep`, and samples before `since`.
    pub fn retain(&self, model: &str, keep: &[u32], since: Instant) {
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        samples.retain(|(m, v), kept| {
            if m != model {
                return true;
            }
            while kept.front().is_some_and(|s| s.at < since) {
                kept.pop_front();
            }
            keep.contains(v) && !kept.is_empty()
        });
    }
}

/// When a canary is rolled back. Configured on the coordinator (`--canary-*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    /// The window the rates and percentiles are taken over.
    pub window: Duration,
    /// Failed / all of the canary's requests in the window: above this, it rolls back.
    pub max_error_rate: f64,
    /// The canary's TTFT p99 over the stable version's: above this, it rolls back.
    pub max_ttft_ratio: f64,
    /// Requests of a version needed in the window before it is judged.
    pub min_requests: usize,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        Thresholds {
            window: Duration::from_secs(60),
            max_error_rate: 0.01,
            max_ttft_ratio: 1.5,
            min_requests: 20,
        }
    }
}

/// The coordinator's flags for [`Thresholds`].
#[derive(Debug, clap::Args)]
pub struct CanaryArgs {
    /// Seconds of a canary's requests that its error rate and TTFT p99 are taken over.
    #[arg(
        long,
        value_name = "SECONDS",
        env = "TESSERA_CANARY_WINDOW",
        default_value_t = 60
    )]
    pub canary_window: u64,
    /// A canary whose error rate over the window passes this percent is rolled back.
    #[arg(
        long,
        value_name = "PERCENT",
        env = "TESSERA_CANARY_MAX_ERROR_PERCENT",
        default_value_t = 1.0
    )]
    pub canary_max_error_percent: f64,
    /// A canary whose TTFT p99 passes this multiple of the stable version's is rolled back.
    #[arg(
        long,
        value_name = "RATIO",
        env = "TESSERA_CANARY_MAX_TTFT_RATIO",
        default_value_t = 1.5
    )]
    pub canary_max_ttft_ratio: f64,
    /// Requests a version needs in the window before it is judged.
    #[arg(
        long,
        value_name = "N",
        env = "TESSERA_CANARY_MIN_REQUESTS",
        default_value_t = 20
    )]
    pub canary_min_requests: usize,
}

impl CanaryArgs {
    /// The thresholds, or what is wrong with the flags.
    pub fn thresholds(&self) -> Result<Thresholds, String> {
        if self.canary_window == 0 {
            return Err("--canary-window must be at least 1 second".into());
        }
        if !(0.0..=100.0).contains(&self.canary_max_error_percent) {
            return Err("--canary-max-error-percent must be 0 to 100".into());
        }
        if self.canary_max_ttft_ratio.is_nan() || self.canary_max_ttft_ratio < 1.0 {
            return Err("--canary-max-ttft-ratio must be at least 1".into());
        }
        Ok(Thresholds {
            window: Duration::from_secs(self.canary_window),
            max_error_rate: self.canary_max_error_percent / 100.0,
            max_ttft_ratio: self.canary_max_ttft_ratio,
            min_requests: self.canary_min_requests,
        })
    }
}

/// Why the canary must roll back (a sentence for the log, the event and the status
/// page), or `None` while it may go on.
pub fn judge(canary: &[Sample], stable: &[Sample], limits: &Thresholds) -> Option<String> {
    if canary.len() < limits.min_requests.max(1) {
        return None;
    }
    let failed = canary.iter().filter(|s| s.failed).count();
    let rate = failed as f64 / canary.len() as f64;
    if rate > limits.max_error_rate {
        return Some(format!(
            "error rate {:.1}% ({failed} of {} requests) over {} s passed the limit of {}%",
            rate * 100.0,
            canary.len(),
            limits.window.as_secs(),
            limits.max_error_rate * 100.0
        ));
    }
    let (Some(c99), Some(s99)) = (p99(canary, limits), p99(stable, limits)) else {
        return None;
    };
    if c99.as_secs_f64() > limits.max_ttft_ratio * s99.as_secs_f64() {
        return Some(format!(
            "TTFT p99 {:.0} ms over {} s passed {}× the stable version's {:.0} ms",
            c99.as_secs_f64() * 1e3,
            limits.window.as_secs(),
            limits.max_ttft_ratio,
            s99.as_secs_f64() * 1e3
        ));
    }
    None
}

/// The 99th percentile of the samples' TTFTs (nearest rank), when there are enough.
fn p99(samples: &[Sample], limits: &Thresholds) -> Option<Duration> {
    let mut ttfts: Vec<Duration> = samples.iter().filter_map(|s| s.ttft).collect();
    if ttfts.len() < limits.min_requests.max(1) {
        return None;
    }
    ttfts.sort_unstable();
    let rank = (ttfts.len() * 99).div_ceil(100);
    Some(ttfts[rank.max(1) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(n: usize, failed: usize, ttft_ms: u64) -> Vec<Sample> {
        let at = Instant::now();
        (0..n)
            .map(|i| Sample {
                at,
                failed: i < failed,
                ttft: (i >= failed).then(|| Duration::from_millis(ttft_ms)),
            })
            .collect()
    }

    #[test]
    fn a_canary_fails_on_errors_or_slow_first_tokens_and_only_with_enough_requests() {
        let limits = Thresholds::default();
        let stable = samples(100, 0, 100);
        assert_eq!(
            judge(&samples(100, 1, 100), &stable, &limits),
            None,
            "1% is the limit"
        );
        let verdict = judge(&samples(100, 2, 100), &stable, &limits).unwrap();
        assert!(
            verdict.contains("error rate 2.0% (2 of 100 requests)"),
            "{verdict}"
        );
        // Too few requests to judge, however they went.
        assert_eq!(judge(&samples(19, 19, 100), &stable, &limits), None);
        assert!(judge(&samples(20, 20, 100), &stable, &limits).is_some());
        // Slow first tokens: 1.5× is allowed, more is not.
        assert_eq!(judge(&samples(100, 0, 150), &stable, &limits), None);
        let verdict = judge(&samples(100, 0, 151), &stable, &limits).unwrap();
        assert!(verdict.contains("TTFT p99 151 ms"), "{verdict}");
        // Without enough stable requests to compare, TTFT says nothing.
        assert_eq!(
            judge(&samples(100, 0, 900), &samples(5, 0, 100), &limits),
            None
        );
    }

    #[test]
    fn p99_is_the_nearest_rank() {
        let limits = Thresholds {
            min_requests: 1,
            ..Thresholds::default()
        };
        let mut s = samples(200, 0, 10);
        s[199].ttft = Some(Duration::from_millis(500));
        s[198].ttft = Some(Duration::from_millis(400));
        s[197].ttft = Some(Duration::from_millis(300));
        // Rank 198 of 200.
        assert_eq!(p99(&s, &limits), Some(Duration::from_millis(300)));
    }

    #[test]
    fn outcomes_are_bounded_per_version_and_forgotten_with_their_version() {
        let outcomes = Outcomes::default();
        for _ in 0..MAX_SAMPLES + 10 {
            outcomes.record("m", 2, false, None);
        }
        outcomes.record("m", 1, true, None);
        outcomes.record("other", 7, true, None);
        let start = Instant::now() - Duration::from_secs(1);
        assert_eq!(outcomes.since("m", 2, start).len(), MAX_SAMPLES);
        outcomes.retain("m", &[1], start);
        assert!(outcomes.since("m", 2, start).is_empty());
        assert_eq!(outcomes.since("m", 1, start).len(), 1);
        assert_eq!(outcomes.since("other", 7, start).len(), 1);
    }
}
