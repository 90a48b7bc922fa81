//! `tessera bench`: a load generator for any OpenAI-compatible server (Tessera's
//! coordinator, vLLM, llama.cpp's server), measuring what users feel — time to first token
//! (TTFT), inter-token latency (ITL), time per output token (TPOT), end-to-end latency —
//! and what the server delivers: requests, output tokens and all tokens per second.
//!
//! - [`args`]: the flags and the validated [`args::BenchConfig`].
//! - [`workload`]: each request's prompt and lengths, a pure function of seed and index.
//! - [`client`]: one timed request (streamed with [`crate::http::sse`], or whole).
//! - [`driver`]: the closed loop (`--concurrency`) or open loop (`--rate`) of worker threads.
//! - [`stats`]: percentiles and the run's summary, pure.
//! - [`report`]: the table on stdout and the JSON of `--json`.
//!
//! Blocking `ureq` on one thread per request in flight: the client's own work per chunk is
//! microseconds, far below the latencies measured, and `Instant` stamps every read.

mod args;
mod client;
mod driver;
mod report;
mod stats;
mod workload;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub use args::BenchArgs;
use args::{BenchConfig, Endpoint};
use client::{Client, ClientSettings, Outcome};
use report::{Report, RunInfo};
use workload::{SyntheticPrompts, Workload};

use crate::http::{api_key, base_url};

/// Runs the benchmark `args` describe. Fails when no measured request succeeded.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let config = BenchConfig::from_args(args)?;
    let workload = match &args.prompts {
        Some(path) => Workload::from_file(
            path,
            args.seed,
            args.output_tokens,
            args.endpoint == Endpoint::Chat,
        )?,
        None => Workload::synthetic(
            args.seed,
            match args.prompt_token_ids {
                Some(vocab) => SyntheticPrompts::TokenIds { vocab },
                None => SyntheticPrompts::Words,
            },
            args.prompt_tokens,
            args.output_tokens,
        ),
    };
    let base = base_url(&args.url);
    let settings = ClientSettings {
        base: base.clone(),
        api_key: api_key(args.api_key.as_deref()),
        endpoint: args.endpoint,
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
    };
    let mut client = Client::new(settings, &config);
    client.resolve_model(args.model.clone())?;

    let progress = progress_bar(&config);
    let on_done = |outcome: &Outcome| {
        progress.inc(1);
        if outcome.is_err() {
            progress.set_message("(with errors)");
        }
    };
    let result = driver::run(&client, &workload, &config, &on_done);
    progress.finish_and_clear();

    let info = RunInfo {
        label: args.label.clone(),
        url: &base,
        model: client.model(),
        endpoint: args.endpoint,
        prompts: match (&args.prompts, args.prompt_token_ids) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(vocab)) => format!(
                "{} tokens (synthetic token ids below {vocab})",
                args.prompt_tokens
            ),
            (None, None) => format!("{} tokens (synthetic)", args.prompt_tokens),
        },
        output_tokens: args.output_tokens.to_string(),
        warmup_failed: result.warmup_failed,
    };
    let report = Report::new(info, &config, &result.outcomes, result.wall);
    let mut stdout = std::io::stdout().lock();
    report.write_table(&mut stdout)?;
    stdout.flush()?;
    if let Some(path) = &args.json {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .with_context(|| format!("cannot write the report to {}", path.display()))?;
    }
    if report.summary.completed == 0 {
        anyhow::bail!("no request succeeded ({} failed)", report.failed);
    }
    Ok(ExitCode::SUCCESS)
}

/// Requests done out of the total on stderr, or elapsed time for a `--duration` run;
/// hidden when stderr is not a terminal.
fn progress_bar(config: &BenchConfig) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match config.stop.requests {
        Some(n) => ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} requests, {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
        None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
            ProgressStyle::with_template("{spinner} {pos} requests, {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    };
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}
