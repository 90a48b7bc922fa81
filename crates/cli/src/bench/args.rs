//! `tessera bench`'s flags ([`BenchArgs`]) and the validated run they describe
//! ([`BenchConfig`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, ValueEnum};

use super::workload::LengthSpec;

/// Requests of a run given neither `--requests` nor `--duration`.
const DEFAULT_REQUESTS: u64 = 100;

/// Which API the requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `POST /v1/completions` with a text prompt.
    Completions,
    /// `POST /v1/chat/completions` with messages.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::Chat => "/v1/chat/completions",
        }
    }
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Base URL of the OpenAI-compatible server (no `/v1`).
    #[arg(
        long,
        env = "TESSERA_BENCH_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub url: String,
    /// Model to ask for (default: the first that `GET /v1/models` lists).
    #[arg(long, env = "TESSERA_BENCH_MODEL")]
    pub model: Option<String>,
    /// Bearer token for the server (also read from OPENAI_API_KEY).
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Which API to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Closed loop: this many requests in flight at all times (default 1 without --rate).
    #[arg(long, conflicts_with = "rate")]
    pub concurrency: Option<usize>,
    /// Open loop: requests per second, arriving as a Poisson process (seeded).
    #[arg(long)]
    pub rate: Option<f64>,
    /// With --rate: the most requests in flight; later arrivals wait for a free slot.
    #[arg(long, default_value_t = 256, requires = "rate")]
    pub max_concurrency: usize,
    /// Measured requests to send (default 100 when --duration is not given either).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Stop sending after this many seconds of the measured phase (requests in flight
    /// then finish and count).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Requests sent before the measured phase and left out of the statistics.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Prompt length in tokens: `128`, `64..256` (uniform) or `normal:MEAN,STDDEV`.
    #[arg(long, default_value = "128", conflicts_with = "prompts")]
    pub prompt_tokens: LengthSpec,
    /// Output length in tokens (`max_tokens`), in the same forms as --prompt-tokens.
    #[arg(long, default_value = "128")]
    pub output_tokens: LengthSpec,
    /// JSONL file of prompts (`{"prompt": "..."}` or `{"messages": [...]}`, optional
    /// `max_tokens`), used in turn instead of synthetic prompts.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Synthetic prompts of random token ids below VOCAB instead of words, for a server
    /// whose model has no tokenizer (completions only); also asks for `return_token_ids`,
    /// so streamed chunks carry the tokens when there is no text.
    #[arg(long, value_name = "VOCAB", conflicts_with = "prompts")]
    pub prompt_token_ids: Option<u32>,
    /// Seed of the prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask for whole answers instead of streams (no TTFT, ITL or TPOT then).
    #[arg(long)]
    pub no_stream: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Send `ignore_eos: true` and `min_tokens` = `max_tokens` (server extensions) so
    /// outputs have the asked length; `--ignore-eos false` to let the model stop.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub ignore_eos: bool,
    /// A JSON object merged into every request body (e.g. `{"top_k": 1}`).
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Give up on one request after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A name for the run, carried into the report.
    #[arg(long)]
    pub label: Option<String>,
}

/// How requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// `concurrency` requests in flight; each finished one is replaced at once.
    Closed { concurrency: usize },
    /// Poisson arrivals at `rate` per second, at most `max_concurrency` in flight.
    Open { rate: f64, max_concurrency: usize },
}

impl LoadMode {
    /// The most requests in flight at once.
    pub fn max_in_flight(self) -> usize {
        match self {
            Self::Closed { concurrency } => concurrency,
            Self::Open {
                max_concurrency, ..
            } => max_concurrency,
        }
    }
}

/// When the measured phase stops sending.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StopRule {
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
}

/// The flags, checked.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub mode: LoadMode,
    pub stop: StopRule,
    pub warmup: u64,
    /// Seed of the workload and of the arrival times.
    pub seed: u64,
    pub stream: bool,
    pub request_timeout: Duration,
    /// Merged into every request body.
    pub extra_body: serde_json::Map<String, serde_json::Value>,
}

impl BenchConfig {
    pub fn from_args(args: &BenchArgs) -> anyhow::Result<Self> {
        let mode = match (args.concurrency, args.rate) {
            (Some(0), _) => bail!("--concurrency must be at least 1"),
            (Some(concurrency), _) => LoadMode::Closed { concurrency },
            (None, Some(rate)) if !(rate.is_finite() && rate > 0.0) => {
                bail!("--rate must be a positive number of requests per second, not {rate}")
            }
            (None, Some(_)) if args.max_concurrency == 0 => {
                bail!("--max-concurrency must be at least 1")
            }
            (None, Some(rate)) => LoadMode::Open {
                rate,
                max_concurrency: args.max_concurrency,
            },
            (None, None) => LoadMode::Closed { concurrency: 1 },
        };
        let duration = match args.duration {
            Some(s) if !(s.is_finite() && s > 0.0) => {
                bail!("--duration must be a positive number of seconds, not {s}")
            }
            Some(s) => Some(Duration::from_secs_f64(s)),
            None => None,
        };
        let requests = match (args.requests, duration) {
            (Some(0), _) => bail!("--requests must be at least 1"),
            (None, None) => Some(DEFAULT_REQUESTS),
            (requests, _) => requests,
        };
        if !(args.request_timeout.is_finite() && args.request_timeout > 0.0) {
            bail!("--request-timeout must be a positive number of seconds");
        }
        if !(args.temperature.is_finite() && args.temperature >= 0.0) {
            bail!(
                "--temperature must be a number ≥ 0, not {}",
                args.temperature
            );
        }
        match (args.prompt_token_ids, args.endpoint) {
            (Some(0), _) => bail!("--prompt-token-ids must be a vocabulary size of at least 1"),
            (Some(_), Endpoint::Chat) => {
                bail!("--prompt-token-ids needs `--endpoint completions` (chat takes messages)")
            }
            _ => {}
        }
        let extra_body = match &args.extra_body {
            None => serde_json::Map::new(),
            Some(text) => match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(map)) => map,
                _ => bail!("--extra-body must be a JSON object, like '{{\"top_k\": 1}}'"),
            },
        };
        Ok(Self {
            mode,
            stop: StopRule { requests, duration },
            warmup: args.warmup,
            seed: args.seed,
            stream: !args.no_stream,
            request_timeout: Duration::from_secs_f64(args.request_timeout),
            extra_body,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<BenchConfig> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))?;
        BenchConfig::from_args(&cli.bench)
    }

    #[test]
    fn defaults_are_one_stream_of_a_hundred_requests() {
        let c = config(&[]).expect("valid");
        assert_eq!(c.mode, LoadMode::Closed { concurrency: 1 });
        assert_eq!(
            c.stop,
            StopRule {
                requests: Some(100),
                duration: None
            }
        );
        assert!(c.stream);
        let c = config(&["--duration", "2.5"]).expect("valid");
        assert_eq!(
            c.stop,
            StopRule {
                requests: None,
                duration: Some(Duration::from_millis(2500))
            }
        );
        let c = config(&["--rate", "4", "--max-concurrency", "8", "--no-stream"]).expect("valid");
        assert_eq!(
            c.mode,
            LoadMode::Open {
                rate: 4.0,
                max_concurrency: 8
            }
        );
        assert!(!c.stream);
    }

    #[test]
    fn bad_flags_are_refused_with_the_flag_named() {
        let error = |args: &[&str]| format!("{:#}", config(args).expect_err("refused"));
        assert!(error(&["--concurrency", "0"]).contains("--concurrency"));
        assert!(error(&["--rate", "0"]).contains("--rate"));
        assert!(error(&["--rate", "1", "--concurrency", "2"]).contains("cannot be used with"));
        assert!(error(&["--requests", "0"]).contains("--requests"));
        assert!(error(&["--duration", "0"]).contains("--duration"));
        assert!(error(&["--extra-body", "[1]"]).contains("JSON object"));
        assert!(error(&["--output-tokens", "9..1"]).contains("range is empty"));
        assert!(error(&["--prompt-token-ids", "0"]).contains("at least 1"));
        assert!(error(&["--prompt-token-ids", "8", "--endpoint", "chat"]).contains("completions"));
        assert!(
            error(&["--prompt-token-ids", "8", "--prompts", "p.jsonl"])
                .contains("cannot be used with")
        );
        assert!(config(&["--prompt-token-ids", "128256"]).is_ok());
    }

    #[test]
    fn ignore_eos_is_on_unless_turned_off() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
                .expect("parses")
                .bench
                .ignore_eos
        };
        assert!(parse(&[]));
        assert!(parse(&["--ignore-eos"]));
        assert!(!parse(&["--ignore-eos", "false"]));
    }
}
