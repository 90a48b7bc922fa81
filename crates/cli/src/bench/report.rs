//! The report of a run: a table for people (stdout) and the same numbers as JSON
//! (`--json`).

use std::collections::HashMap;
use std::io::{self, Write};

use serde::Serialize;

use super::args::{BenchConfig, Endpoint, LoadMode};
use super::client::Outcome;
use super::stats::{Distribution, RequestTimings, Summary};

/// Distinct error messages kept in the report.
const ERRORS_KEPT: usize = 5;

/// One error message and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// How the load was applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum LoadReport {
    Closed {
        concurrency: usize,
    },
    Open {
        rate_per_s: f64,
        max_concurrency: usize,
    },
}

/// Everything `tessera bench` says about a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub label: Option<String>,
    pub url: String,
    pub model: String,
    pub endpoint: &'static str,
    pub stream: bool,
    pub load: LoadReport,
    pub seed: u64,
    /// `--prompt-tokens`, or the prompts file.
    pub prompts: String,
    pub output_tokens: String,
    pub warmup_requests: u64,
    pub warmup_failed: usize,
    /// Measured requests sent.
    pub requests: usize,
    pub failed: usize,
    /// Successful requests whose token counts came from the server's `usage`.
    pub usage_reported: usize,
    /// The first distinct error messages, in order of first appearance.
    pub errors: Vec<ErrorCount>,
    pub distinct_errors: usize,
    pub wall_s: f64,
    #[serde(flatten)]
    pub summary: Summary,
}

/// What the report needs besides the outcomes.
#[derive(Debug, Clone)]
pub struct RunInfo<'a> {
    pub label: Option<String>,
    pub url: &'a str,
    pub model: &'a str,
    pub endpoint: Endpoint,
    pub prompts: String,
    pub output_tokens: String,
    pub warmup_failed: usize,
}

impl Report {
    pub fn new(
        info: RunInfo<'_>,
        config: &BenchConfig,
        outcomes: &[Outcome],
        wall: std::time::Duration,
    ) -> Self {
        let mut timings: Vec<RequestTimings> = Vec::new();
        let mut usage_reported = 0;
        let mut errors: Vec<&str> = Vec::new();
        for outcome in outcomes {
            match outcome {
                Ok(finished) => {
                    usage_reported += usize::from(finished.usage_reported);
                    timings.push(finished.timings.clone());
                }
                Err(message) => errors.push(message),
            }
        }
        let (kept, distinct_errors) = count_errors(&errors, ERRORS_KEPT);
        Self {
            label: info.label,
            url: info.url.to_owned(),
            model: info.model.to_owned(),
            endpoint: info.endpoint.path(),
            stream: config.stream,
            load: match config.mode {
                LoadMode::Closed { concurrency } => LoadReport::Closed { concurrency },
                LoadMode::Open {
                    rate,
                    max_concurrency,
                } => LoadReport::Open {
                    rate_per_s: rate,
                    max_concurrency,
                },
            },
            seed: config.seed,
            prompts: info.prompts,
            output_tokens: info.output_tokens,
            warmup_requests: config.warmup,
            warmup_failed: info.warmup_failed,
            requests: outcomes.len(),
            failed: errors.len(),
            usage_reported,
            errors: kept,
            distinct_errors,
            wall_s: wall.as_secs_f64(),
            summary: Summary::of(&timings, wall),
        }
    }

    /// The table for people.
    pub fn write_table(&self, out: &mut impl Write) -> io::Result<()> {
        let s = &self.summary;
        let title = self
            .label
            .as_deref()
            .map_or(String::new(), |l| format!(" — {l}"));
        writeln!(out, "tessera bench{title}")?;
        let mode = if self.stream {
            "streaming"
        } else {
            "whole answers"
        };
        writeln!(
            out,
            "  server      {} ({}, {}, {mode})",
            self.url, self.model, self.endpoint
        )?;
        match self.load {
            LoadReport::Closed { concurrency } => {
                writeln!(out, "  load        closed loop, concurrency {concurrency}")?;
            }
            LoadReport::Open {
                rate_per_s,
                max_concurrency,
            } => writeln!(
                out,
                "  load        open loop, {rate_per_s} req/s (Poisson), at most {max_concurrency} in flight"
            )?,
        }
        writeln!(
            out,
            "  workload    prompts {}, output {} tokens, seed {}",
            self.prompts, self.output_tokens, self.seed
        )?;
        let warmup = if self.warmup_requests > 0 {
            format!(" (+{} warmup, not counted)", self.warmup_requests)
        } else {
            String::new()
        };
        writeln!(
            out,
            "  requests    {} ok, {} failed{warmup}; wall {:.2} s",
            s.completed, self.failed, self.wall_s
        )?;
        let per_request = |n: usize| {
            if s.completed > 0 {
                n as f64 / s.completed as f64
            } else {
                0.0
            }
        };
        writeln!(
            out,
            "  tokens      prompt {} ({:.1}/request), output {} ({:.1}/request){}",
            s.prompt_tokens_total,
            per_request(s.prompt_tokens_total),
            s.completion_tokens_total,
            per_request(s.completion_tokens_total),
            if self.usage_reported < s.completed {
                "; some counted by the client (no usage)"
            } else {
                ""
            }
        )?;
        writeln!(
            out,
            "  throughput  {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            s.request_throughput_per_s,
            s.output_token_throughput_per_s,
            s.total_token_throughput_per_s
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "  {:<6} {:>10} {:>10} {:>10} {:>10} {:>8}",
            "ms", "mean", "p50", "p90", "p99", "n"
        )?;
        for (name, d) in [
            ("TTFT", &s.ttft),
            ("ITL", &s.itl),
            ("TPOT", &s.tpot),
            ("E2E", &s.e2e),
        ] {
            write_row(out, name, d.as_ref())?;
        }
        if !self.errors.is_empty() {
            writeln!(out)?;
            writeln!(out, "  errors ({} distinct):", self.distinct_errors)?;
            for e in &self.errors {
                writeln!(out, "    {:>5} × {}", e.count, e.message)?;
            }
        }
        Ok(())
    }
}

fn write_row(out: &mut impl Write, name: &str, d: Option<&Distribution>) -> io::Result<()> {
    match d {
        Some(d) => writeln!(
            out,
            "  {name:<6} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8}",
            d.mean_ms, d.p50_ms, d.p90_ms, d.p99_ms, d.count
        ),
        None => writeln!(out, "  {name:<6} {:>10}", "-"),
    }
}

/// The first `keep` distinct messages with their counts, and how many distinct there are.
fn count_errors(errors: &[&str], keep: usize) -> (Vec<ErrorCount>, usize) {
    let mut order: Vec<&str> = Vec::new();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for &message in errors {
        let count = counts.entry(message).or_insert(0);
        if *count == 0 {
            order.push(message);
        }
        *count += 1;
    }
    let kept = order
        .iter()
        .take(keep)
        .map(|&message| ErrorCount {
            message: message.to_owned(),
            count: counts[message],
        })
        .collect();
    (kept, order.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_grouped_in_order_of_first_appearance() {
        let errors = [
            "HTTP 500: a",
            "HTTP 503: b",
            "HTTP 500: a",
            "c",
            "d",
            "e",
            "f",
            "c",
        ];
        let (kept, distinct) = count_errors(&errors, 5);
        assert_eq!(distinct, 6);
        let kept: Vec<(&str, usize)> = kept.iter().map(|e| (e.message.as_str(), e.count)).collect();
        assert_eq!(
            kept,
            [
                ("HTTP 500: a", 2),
                ("HTTP 503: b", 1),
                ("c", 2),
                ("d", 1),
                ("e", 1)
            ]
        );
        assert_eq!(count_errors(&[], 5), (Vec::new(), 0));
    }
}
