//! What each request asks: its prompt and its output length.
//!
//! Request `i` of a run is a pure function of the seed and `i` (its own random stream), so
//! the same seed gives the same requests in the same order whatever the concurrency or the
//! timing. Synthetic prompts are common English words chosen at random: with a leading
//! space each is one token in the BPE vocabularies of Llama, Qwen, Mistral and SmolLM, so
//! `N` words make about `N` prompt tokens without a tokenizer here; the server's `usage`
//! gives the real count. For a model served without a tokenizer, synthetic prompts can
//! instead be random token ids below the vocabulary size: exactly `N` tokens.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{Context, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

/// A length in tokens: fixed, uniform over a range, or normal (rounded, at least 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthSpec {
    /// `128`.
    Fixed(usize),
    /// `64..256`: uniform over the inclusive range.
    Uniform { low: usize, high: usize },
    /// `normal:MEAN,STDDEV`.
    Normal { mean: f64, stddev: f64 },
}

impl LengthSpec {
    /// Draws one length (at least 1).
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        match *self {
            Self::Fixed(n) => n,
            Self::Uniform { low, high } => rng.random_range(low..=high),
            Self::Normal { mean, stddev } => {
                // Box–Muller; `1 − u` keeps the logarithm's argument in (0, 1].
                let u1: f64 = 1.0 - rng.random::<f64>();
                let u2: f64 = rng.random();
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (mean + stddev * z).round().max(1.0) as usize
            }
        }
    }
}

impl fmt::Display for LengthSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Uniform { low, high } => write!(f, "{low}..{high}"),
            Self::Normal { mean, stddev } => write!(f, "normal:{mean},{stddev}"),
        }
    }
}

impl FromStr for LengthSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let count = |text: &str| -> Result<usize, String> {
            match text.trim().parse::<usize>() {
                Ok(0) => Err(format!("`{s}`: a length must be at least 1 token")),
                Ok(n) => Ok(n),
                Err(_) => Err(format!(
                    "`{s}`: `{}` is not a whole number of tokens; give `128`, `64..256` or \
                     `normal:MEAN,STDDEV`",
                    text.trim()
                )),
            }
        };
        if let Some(params) = s.strip_prefix("normal:") {
            let Some((mean, stddev)) = params.split_once(',') else {
                return Err(format!(
                    "`{s}`: write a normal distribution as `normal:MEAN,STDDEV`"
                ));
            };
            let number = |text: &str| -> Result<f64, String> {
                text.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| format!("`{s}`: `{}` is not a number", text.trim()))
            };
            let (mean, stddev) = (number(mean)?, number(stddev)?);
            if mean < 1.0 {
                return Err(format!(
                    "`{s}`: the mean must be at least 1 token, not {mean}"
                ));
            }
            if stddev < 0.0 {
                return Err(format!("`{s}`: the standard deviation cannot be negative"));
            }
            return Ok(Self::Normal { mean, stddev });
        }
        if let Some((low, high)) = s.split_once("..") {
            let high = high.strip_prefix('=').unwrap_or(high);
            let (low, high) = (count(low)?, count(high)?);
            if low > high {
                return Err(format!("`{s}`: the range is empty ({low} > {high})"));
            }
            return Ok(Self::Uniform { low, high });
        }
        count(s).map(Self::Fixed)
    }
}

/// What synthetic prompts are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticPrompts {
    /// Common English words, about one token each.
    Words,
    /// Token ids drawn uniformly from `0..vocab`, one token each.
    TokenIds { vocab: u32 },
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text for `/v1/completions` (or one user message for chat).
    Text(String),
    /// Token ids for `/v1/completions`.
    Tokens(Vec<u32>),
    /// A chat conversation, as given in a prompts file.
    Messages(Value),
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub prompt: Prompt,
    /// The prompt's length in tokens as far as the client knows (synthetic: the word count;
    /// from a file: 0), used when the server reports no usage.
    pub prompt_tokens_estimate: usize,
    pub max_tokens: usize,
}

/// A line of a prompts file.
#[derive(Debug, Clone, PartialEq)]
struct FilePrompt {
    prompt: Prompt,
    max_tokens: Option<usize>,
}

/// Where the requests come from.
#[derive(Debug, Clone)]
pub struct Workload {
    seed: u64,
    synthetic: SyntheticPrompts,
    prompt_tokens: LengthSpec,
    output_tokens: LengthSpec,
    /// Prompts of a `--prompts` file, used in turn; synthetic prompts when empty.
    file: Vec<FilePrompt>,
}

impl Workload {
    pub fn synthetic(
        seed: u64,
        synthetic: SyntheticPrompts,
        prompt_tokens: LengthSpec,
        output_tokens: LengthSpec,
    ) -> Self {
        Self {
            seed,
            synthetic,
            prompt_tokens,
            output_tokens,
            file: Vec::new(),
        }
    }

    /// The prompts of a JSONL file: one object per line with `prompt` (text) or `messages`
    /// (a chat list), and optionally `max_tokens`; blank lines are skipped.
    pub fn from_file(
        path: &Path,
        seed: u64,
        output_tokens: LengthSpec,
        chat: bool,
    ) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the prompts file {}", path.display()))?;
        let file = parse_prompts(&text, chat)
            .with_context(|| format!("in the prompts file {}", path.display()))?;
        Ok(Self {
            seed,
            synthetic: SyntheticPrompts::Words,
            prompt_tokens: LengthSpec::Fixed(1),
            output_tokens,
            file,
        })
    }

    /// Request `index` of the run.
    pub fn request(&self, index: u64) -> RequestSpec {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(index);
        if self.file.is_empty() {
            let tokens = self.prompt_tokens.sample(&mut rng);
            let prompt = match self.synthetic {
                SyntheticPrompts::Words => Prompt::Text(synthetic_prompt(&mut rng, tokens)),
                SyntheticPrompts::TokenIds { vocab } => {
                    Prompt::Tokens((0..tokens).map(|_| rng.random_range(0..vocab)).collect())
                }
            };
            return RequestSpec {
                prompt,
                prompt_tokens_estimate: tokens,
                max_tokens: self.output_tokens.sample(&mut rng),
            };
        }
        let line = &self.file[(index % self.file.len() as u64) as usize];
        RequestSpec {
            prompt: line.prompt.clone(),
            prompt_tokens_estimate: 0,
            max_tokens: line
                .max_tokens
                .unwrap_or_else(|| self.output_tokens.sample(&mut rng)),
        }
    }
}

fn parse_prompts(text: &str, chat: bool) -> anyhow::Result<Vec<FilePrompt>> {
    let mut prompts = Vec::new();
    for (number, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .with_context(|| format!("line {number} is not a JSON object"))?;
        let max_tokens = match &value["max_tokens"] {
            Value::Null => None,
            v => match v.as_u64() {
                Some(n) if n >= 1 => Some(n as usize),
                _ => bail!("line {number}: `max_tokens` must be a whole number ≥ 1, not {v}"),
            },
        };
        let prompt = match (&value["prompt"], &value["messages"]) {
            (Value::String(text), Value::Null) => Prompt::Text(text.clone()),
            (Value::Null, messages @ Value::Array(_)) if chat => Prompt::Messages(messages.clone()),
            (Value::Null, Value::Array(_)) => {
                bail!("line {number} has `messages`, which need `--endpoint chat`")
            }
            _ => {
                bail!("line {number}: give either `\"prompt\": \"text\"` or `\"messages\": [...]`")
            }
        };
        prompts.push(FilePrompt { prompt, max_tokens });
    }
    if prompts.is_empty() {
        bail!("no prompt in the file");
    }
    Ok(prompts)
}

/// About `words` tokens of random common words.
fn synthetic_prompt(rng: &mut impl Rng, words: usize) -> String {
    let mut prompt = String::with_capacity(words * 6);
    for i in 0..words {
        let word = WORDS[rng.random_range(0..WORDS.len())];
        if i > 0 {
            prompt.push(' ');
        }
        prompt.push_str(word);
    }
    prompt
}

/// Frequent English words, each a single token (with its leading space) in common BPE
/// vocabularies.
#[rustfmt::skip]
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "with", "as", "on", "by", "he",
    "at", "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "first", "also",
    "new", "had", "has", "their", "after", "its", "not", "but", "who", "her", "they", "she", "two",
    "been", "other", "when", "there", "all", "time", "during", "into", "school", "more", "may",
    "years", "over", "only", "year", "most", "would", "world", "city", "some", "where", "between",
    "later", "three", "state", "such", "then", "national", "used", "made", "known", "under",
    "many", "university", "united", "while", "part", "season", "team", "these", "american", "than",
    "film", "second", "born", "south", "became", "states", "war", "through", "being", "including",
    "both", "before", "north", "high", "however", "people", "family", "early", "history", "album",
    "area", "them", "series", "against", "until", "since", "district", "county", "name", "work",
    "life", "group", "music", "following", "number", "company", "several", "four", "called",
    "played", "released", "career", "league", "game", "government", "house", "each", "based",
    "day", "same", "won", "use", "station", "club", "international", "town", "located",
    "population", "general", "college", "east", "found", "age", "march", "end", "september",
    "began", "home", "public", "church", "line", "june", "river", "member", "system", "place",
    "century", "band", "july", "york", "january", "october", "song", "august", "best", "former",
    "british", "party", "named", "held", "village", "show", "local", "november", "took", "service",
    "december", "built", "another", "major", "within", "along", "members", "five", "single", "due",
    "although", "small", "old", "left", "final", "large", "include", "building", "served",
    "president", "received", "games", "death", "february", "main", "third", "set", "children",
    "own", "order", "species", "park", "law", "air", "published", "road", "died", "book", "men",
    "women", "army", "often", "according", "education", "central", "country", "division",
    "english", "top", "included", "development", "french", "community", "among", "water", "play",
    "side", "list", "times", "near", "late", "form", "original", "different", "center", "power",
    "led", "students", "german", "moved", "court", "six", "land", "council", "island", "record",
    "million", "research", "art", "established", "award", "street", "military", "television",
    "given", "region", "support", "western", "production", "non", "political", "point", "cup",
    "period", "business", "title", "started", "various", "election", "using", "england", "role",
    "produced", "become", "program", "works", "field", "total", "office", "class", "written",
    "association", "radio", "union", "level", "championship", "director", "few", "force",
    "created", "department", "founded", "services", "married", "though", "per", "son", "light",
    "story", "long", "good", "great", "little", "very",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_fixed_ranges_and_normals() {
        assert_eq!("128".parse(), Ok(LengthSpec::Fixed(128)));
        assert_eq!(
            " 64..256 ".parse(),
            Ok(LengthSpec::Uniform { low: 64, high: 256 })
        );
        assert_eq!(
            "64..=256".parse(),
            Ok(LengthSpec::Uniform { low: 64, high: 256 })
        );
        assert_eq!("8..8".parse(), Ok(LengthSpec::Uniform { low: 8, high: 8 }));
        assert_eq!(
            "normal:128,32.5".parse(),
            Ok(LengthSpec::Normal {
                mean: 128.0,
                stddev: 32.5
            })
        );
    }

    #[test]
    fn bad_lengths_say_what_is_wrong() {
        let error = |s: &str| s.parse::<LengthSpec>().expect_err(s);
        assert!(error("0").contains("at least 1"), "{}", error("0"));
        assert!(
            error("abc").contains("`abc` is not a whole number"),
            "{}",
            error("abc")
        );
        assert!(error("-5").contains("not a whole number"));
        assert!(
            error("256..64").contains("range is empty (256 > 64)"),
            "{}",
            error("256..64")
        );
        assert!(error("10..x").contains("`x`"));
        assert!(error("normal:128").contains("normal:MEAN,STDDEV"));
        assert!(error("normal:abc,1").contains("`abc` is not a number"));
        assert!(error("normal:0.5,1").contains("mean must be at least 1"));
        assert!(error("normal:100,-1").contains("cannot be negative"));
    }

    #[test]
    fn lengths_sample_within_their_bounds() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert_eq!(LengthSpec::Fixed(7).sample(&mut rng), 7);
        let uniform = LengthSpec::Uniform { low: 3, high: 5 };
        let draws: Vec<usize> = (0..200).map(|_| uniform.sample(&mut rng)).collect();
        assert!(draws.iter().all(|n| (3..=5).contains(n)));
        assert!(
            (3..=5).all(|n| draws.contains(&n)),
            "every value of the range appears"
        );
        // A wide normal is clamped at 1; its mean stays near the asked one.
        let normal = LengthSpec::Normal {
            mean: 100.0,
            stddev: 10.0,
        };
        let draws: Vec<usize> = (0..2000).map(|_| normal.sample(&mut rng)).collect();
        let mean = draws.iter().sum::<usize>() as f64 / draws.len() as f64;
        assert!((mean - 100.0).abs() < 2.0, "mean {mean}");
        let clamped = LengthSpec::Normal {
            mean: 1.0,
            stddev: 50.0,
        };
        assert!((0..200).all(|_| clamped.sample(&mut rng) >= 1));
    }

    #[test]
    fn requests_depend_only_on_seed_and_index() {
        let workload = Workload::synthetic(
            7,
            SyntheticPrompts::Words,
            LengthSpec::Fixed(16),
            "4..8".parse().expect("ok"),
        );
        let a = workload.request(3);
        assert_eq!(a, workload.request(3));
        assert_ne!(a.prompt, workload.request(4).prompt);
        let Prompt::Text(text) = &a.prompt else {
            panic!("text")
        };
        assert_eq!(text.split(' ').count(), 16);
        assert_eq!(a.prompt_tokens_estimate, 16);
        assert!((4..=8).contains(&a.max_tokens));
        let other = Workload::synthetic(
            8,
            SyntheticPrompts::Words,
            LengthSpec::Fixed(16),
            LengthSpec::Fixed(4),
        );
        assert_ne!(other.request(3).prompt, a.prompt);
    }

    #[test]
    fn token_id_prompts_have_the_asked_length_below_the_vocabulary() {
        let ids = |seed: u64, vocab: u32| {
            let workload = Workload::synthetic(
                seed,
                SyntheticPrompts::TokenIds { vocab },
                "100..120".parse().expect("ok"),
                LengthSpec::Fixed(4),
            );
            (0..50)
                .map(|i| {
                    let request = workload.request(i);
                    let Prompt::Tokens(ids) = request.prompt else {
                        panic!("token ids")
                    };
                    assert_eq!(request.prompt_tokens_estimate, ids.len());
                    assert!((100..=120).contains(&ids.len()), "{}", ids.len());
                    ids
                })
                .collect::<Vec<_>>()
        };
        let prompts = ids(3, 1000);
        assert_eq!(prompts, ids(3, 1000), "a function of seed and index");
        assert_ne!(prompts, ids(4, 1000));
        let all: Vec<u32> = prompts.concat();
        assert!(all.iter().all(|&id| id < 1000));
        // Uniform over the vocabulary: both ends of it are drawn, and the mean is near
        // its middle (5,000+ draws: the mean's standard error is about 4).
        assert!(all.iter().any(|&id| id < 10) && all.iter().any(|&id| id >= 990));
        let mean = all.iter().map(|&id| f64::from(id)).sum::<f64>() / all.len() as f64;
        assert!((mean - 499.5).abs() < 25.0, "mean {mean}");
        assert!(ids(5, 1).concat().iter().all(|&id| id == 0));
    }

    #[test]
    fn prompt_files_take_text_messages_and_lengths() {
        let text = "{\"prompt\": \"Hello\", \"max_tokens\": 5}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}\n";
        let prompts = parse_prompts(text, true).expect("parses");
        assert_eq!(prompts.len(), 2);
        assert_eq!(prompts[0].prompt, Prompt::Text("Hello".into()));
        assert_eq!(prompts[0].max_tokens, Some(5));
        assert!(matches!(prompts[1].prompt, Prompt::Messages(_)));
        assert_eq!(prompts[1].max_tokens, None);

        let error =
            |text: &str, chat: bool| format!("{:#}", parse_prompts(text, chat).expect_err(text));
        assert!(
            error(text, false).contains("line 3 has `messages`"),
            "{}",
            error(text, false)
        );
        assert!(error("{\"prompt\": 1}", false).contains("line 1: give either"));
        assert!(error("nope", false).contains("line 1 is not a JSON object"));
        assert!(error("{\"prompt\": \"a\", \"max_tokens\": 0}", false).contains("max_tokens"));
        assert!(error("\n\n", false).contains("no prompt"));
    }
}
