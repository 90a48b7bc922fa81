//! `tessera generate`: load a model into this process and generate, streaming the text to
//! stdout (or printing one JSON object with `--json`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{ArgGroup, Args};
use serde::Serialize;
use tessera_kernels::sampling::SamplingParams;
use tessera_model::generate::{GenerationRequest, generate};
use tessera_model::loader::{LoadedModel, load};

/// Arguments of `tessera generate`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "chat", "prompt_tokens"])))]
pub struct GenerateArgs {
    /// A HuggingFace model directory or a .gguf file; with --url, the served model's name
    /// [default with --url: the first of the server's GET /v1/models].
    #[arg(long, env = "TESSERA_MODEL", required_unless_present = "url")]
    pub model: Option<PathBuf>,
    /// Ask the server at this URL (POST /v1/completions, or /v1/chat/completions for
    /// --chat) instead of loading the model in this process; --threads is then ignored.
    #[arg(long, env = "TESSERA_URL")]
    pub url: Option<String>,
    /// With --url: the server's API key [default: OPENAI_API_KEY].
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Raw prompt text (no chat template).
    #[arg(long)]
    pub prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long)]
    pub chat: Option<String>,
    /// Prompt as comma-separated token ids (works without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_tokens: Option<Vec<u32>>,
    /// Tokens to generate at most [default: 256, or what the context leaves].
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed for sampling; random when absent.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute threads (default: all cores).
    #[arg(long, env = "TESSERA_THREADS")]
    pub threads: Option<usize>,
    /// `exact` (f32 activations, token for token with transformers) or `fast` (8-bit
    /// activations and integer dot products on Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS weights, as llama.cpp).
    #[arg(long, env = "TESSERA_PRECISION", default_value = "exact")]
    pub precision: tessera_topology::Precision,
    /// Do not stop at the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

impl GenerateArgs {
    /// The local model's path (clap requires `--model` unless `--url` is given).
    fn model_path(&self) -> &Path {
        self.model.as_deref().unwrap_or(Path::new(""))
    }
}

/// Tokens generated when `--max-tokens` is not given (less if the context is shorter).
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// The `--json` output.
#[derive(Debug, Serialize)]
struct JsonOutput {
    model: String,
    prompt_tokens: usize,
    prompt_token_ids: Vec<u32>,
    tokens: Vec<u32>,
    text: Option<String>,
    finish_reason: &'static str,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    threads: usize,
    precision: &'static str,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    if args.temperature.is_nan() || args.temperature < 0.0 {
        bail!("--temperature must be 0 or more, got {}", args.temperature);
    }
    if !(0.0..=1.0).contains(&args.top_p) || args.top_p == 0.0 {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if let Some(url) = &args.url {
        return crate::remote::generate(url, args);
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting the compute threads")?;
    let mut model = load(args.model_path())?;
    model.llama.set_precision(args.precision);
    let prompt = prompt_tokens(args, &model)?;
    let mut stop_tokens = Vec::new();
    if !args.ignore_eos {
        stop_tokens.extend(model.eos_token_ids());
    }
    let request = GenerationRequest {
        prompt: prompt.clone(),
        max_tokens: args.max_tokens.unwrap_or_else(|| {
            let context = model.llama.config().max_position_embeddings;
            DEFAULT_MAX_TOKENS.min(context.saturating_sub(prompt.len()))
        }),
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop_tokens,
    };
    let fallback_seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut stream = (!args.json)
        .then(|| model.tokenizer.as_ref().map(|t| t.decode_stream(true)))
        .flatten();
    let generation = pool.install(|| {
        generate(&model.llama, &request, fallback_seed, |token| {
            if let Some(stream) = stream.as_mut() {
                let tokenizer = model.tokenizer.as_ref();
                if let Some(Ok(Some(text))) = tokenizer.map(|t| stream.step(t, token)) {
                    let mut stdout = std::io::stdout().lock();
                    let _ = stdout.write_all(text.as_bytes());
                    let _ = stdout.flush();
                }
            }
        })
    })?;
    let mut stdout = std::io::stdout().lock();
    let text = match &model.tokenizer {
        Some(t) => Some(t.decode(&generation.tokens, true)?),
        None => None,
    };
    let prefill = generation.prefill_tokens_per_s(prompt.len());
    let decode = generation.decode_tokens_per_s();
    if args.json {
        let out = JsonOutput {
            model: args.model_path().display().to_string(),
            prompt_tokens: prompt.len(),
            prompt_token_ids: prompt,
            tokens: generation.tokens,
            text,
            finish_reason: generation.finish_reason.as_str(),
            prefill_tokens_per_s: prefill,
            decode_tokens_per_s: decode,
            threads,
            precision: args.precision.as_str(),
        };
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    } else {
        if model.tokenizer.is_none() {
            let ids: Vec<String> = generation.tokens.iter().map(u32::to_string).collect();
            write!(stdout, "{}", ids.join(","))?;
        }
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens, {} generated ({}); prefill {prefill:.1} tok/s, decode {decode:.1} tok/s, {threads} threads]",
            prompt.len(),
            generation.tokens.len(),
            generation.finish_reason.as_str(),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The prompt as token ids, from whichever input was given.
fn prompt_tokens(args: &GenerateArgs, model: &LoadedModel) -> anyhow::Result<Vec<u32>> {
    if let Some(ids) = &args.prompt_tokens {
        if ids.is_empty() {
            bail!("--prompt-tokens needs at least one token id");
        }
        return Ok(ids.clone());
    }
    let Some(tokenizer) = &model.tokenizer else {
        bail!(
            "{} has no tokenizer (tokenizer.json or GGUF vocabulary); pass --prompt-tokens instead",
            args.model_path().display()
        );
    };
    if let Some(text) = &args.prompt {
        return Ok(tokenizer.encode(text, true)?);
    }
    let message = args.chat.as_deref().unwrap_or_default();
    let Some(template) = &model.chat_template else {
        bail!(
            "{} has no chat template; use --prompt instead",
            args.model_path().display()
        );
    };
    let rendered = template.render(
        &[tessera_model::chat::ChatMessage {
            role: "user".into(),
            content: message.into(),
        }],
        true,
    )?;
    // The template already wrote any BOS it wants; do not add special tokens again.
    Ok(tokenizer.encode(&rendered, false)?)
}
