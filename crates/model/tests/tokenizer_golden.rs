//! Golden tests: every tokenizer gives exactly HuggingFace transformers' ids and decodes.
//!
//! The expected values come from `scripts/fixtures/make_tokenizer_fixtures.py`, which runs
//! transformers on the fixtures in `fixtures/tokenizers/` (and on the SmolLM2 GGUF). Each text
//! is checked encoded with and without special tokens, decoded with and without skipping
//! special tokens, and decoded again through `DecodeStream` one id at a time.
//!
//! The SmolLM2 test needs `models/SmolLM2-135M-Instruct.Q4_1.gguf` (placed by
//! `scripts/get-demo-model.sh`); without it the test says so and passes, unless
//! `TESSERA_REQUIRE_DEMO_MODEL=1`, in which case it fails.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_model::gguf::GgufFile;
use tessera_model::tokenizer::{DecodeStream, Tokenizer};

fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .nth(2)
        .unwrap_or(manifest)
        .to_path_buf()
}

fn fixtures() -> PathBuf {
    repo_root().join("fixtures/tokenizers")
}

fn expected() -> Value {
    let path = fixtures().join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn entry(name: &str) -> Value {
    expected()["tokenizers"][name].clone()
}

fn ids(value: &Value) -> Vec<u32> {
    let items = value
        .as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {value}"));
    items.iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

fn text(value: &Value) -> &str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value}"))
}

fn from_gguf(path: &Path) -> Tokenizer {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{e}"));
    Tokenizer::from_gguf(&file)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("{}: no tokenizer", path.display()))
}

/// Streams `ids` through a `DecodeStream` and returns the concatenated pieces.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> String {
    let mut stream = DecodeStream::new(skip_special_tokens);
    let mut out = String::new();
    for &id in ids {
        if let Some(piece) = stream.step(tok, id).unwrap() {
            out.push_str(&piece);
        }
    }
    out.push_str(&stream.finish(tok).unwrap().unwrap_or_default());
    out
}

/// Compares `tok` with every expected case of `entry`; all mismatches are reported together.
fn check(name: &str, tok: &Tokenizer, entry: &Value) {
    let mut failures = Vec::new();
    let mut expect = |what: &str, input: &str, got: String, want: String| {
        if got != want {
            failures.push(format!(
                "{name}: {what} of {input:?}:\n   got {got}\n  want {want}"
            ));
        }
    };
    expect(
        "vocab size",
        "",
        tok.vocab_size().to_string(),
        entry["vocab_size"].to_string(),
    );
    let bos = tok.bos_token_id().map_or(Value::Null, Value::from);
    expect(
        "bos id",
        "",
        bos.to_string(),
        entry["bos_token_id"].to_string(),
    );
    let eos = tok
        .eos_token_ids()
        .first()
        .copied()
        .map_or(Value::Null, Value::from);
    expect(
        "eos id",
        "",
        eos.to_string(),
        entry["eos_token_id"].to_string(),
    );
    let cases = entry["cases"].as_array().expect("cases");
    assert!(cases.len() >= 20, "{name}: only {} cases", cases.len());
    for case in cases {
        let input = text(&case["text"]);
        let plain = ids(&case["ids"]);
        let special = ids(&case["ids_with_special"]);
        let got = tok.encode(input, false).unwrap();
        expect("ids", input, format!("{got:?}"), format!("{plain:?}"));
        let got = tok.encode(input, true).unwrap();
        expect(
            "ids with special",
            input,
            format!("{got:?}"),
            format!("{special:?}"),
        );
        for (ids, skip, key) in [
            (&plain, false, "decode"),
            (&special, false, "decode_with_special"),
            (&special, true, "decode_skip_special"),
        ] {
            let want = text(&case[key]).to_string();
            let got = tok.decode(ids, skip).unwrap();
            expect(key, input, format!("{got:?}"), format!("{want:?}"));
            let streamed = stream(tok, ids, skip);
            expect(
                &format!("streamed {key}"),
                input,
                format!("{streamed:?}"),
                format!("{want:?}"),
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn tiny_bpe_json_matches_transformers() {
    let tok = Tokenizer::from_file(fixtures().join("tiny-bpe")).unwrap();
    check("tiny-bpe-json", &tok, &entry("tiny-bpe-json"));
    // tokenizer_config.json says add_bos_token, but tokenizer.json adds none: the file wins.
    assert!(!tok.add_bos_token());
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), &[2]);
}

#[test]
fn tiny_bpe_gguf_matches_transformers() {
    let tok = from_gguf(&fixtures().join("tiny-bpe.gguf"));
    check("tiny-bpe-gguf", &tok, &entry("tiny-bpe-gguf"));
    assert!(tok.add_bos_token());
    assert_eq!(tok.token_to_id("<think>"), Some(922));
}

#[test]
fn tiny_spm_json_matches_transformers() {
    let tok = Tokenizer::from_file(fixtures().join("tiny-spm/tokenizer.json")).unwrap();
    check("tiny-spm-json", &tok, &entry("tiny-spm-json"));
    assert!(tok.add_bos_token());
}

#[test]
fn tiny_spm_gguf_matches_transformers() {
    let tok = from_gguf(&fixtures().join("tiny-spm.gguf"));
    check("tiny-spm-gguf", &tok, &entry("tiny-spm-gguf"));
    assert!(tok.add_bos_token());
    assert_eq!(tok.token_to_id("<0x41>"), Some(3 + 0x41));
}

/// The tokenizer built from a GGUF has the structure transformers builds (merge order included),
/// apart from the documented digit split for `pre = smollm`.
#[test]
fn gguf_builds_match_transformers_structure() {
    for name in ["tiny-bpe", "tiny-spm"] {
        let tok = from_gguf(&fixtures().join(format!("{name}.gguf")));
        let ours: Value = serde_json::from_str(&tok.inner().to_string(false).unwrap()).unwrap();
        let path = fixtures().join(format!("hf-gguf/{name}.json"));
        let theirs: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for key in [
            "normalizer",
            "post_processor",
            "decoder",
            "model",
            "added_tokens",
        ] {
            assert_eq!(
                ours[key], theirs[key],
                "{name}: `{key}` differs from transformers'"
            );
        }
        if name == "tiny-bpe" {
            let kinds: Vec<&Value> = ours["pre_tokenizer"]["pretokenizers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| &p["type"])
                .collect();
            assert_eq!(kinds, ["Digits", "ByteLevel"]);
        } else {
            assert_eq!(
                ours["pre_tokenizer"], theirs["pre_tokenizer"],
                "{name}: pre_tokenizer"
            );
        }
    }
}

/// The real SmolLM2 GGUF, or `None` (after saying so) when it is absent and not required.
fn smollm2_gguf() -> Option<PathBuf> {
    let path = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    let required = std::env::var("TESSERA_REQUIRE_DEMO_MODEL").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "{} is missing and TESSERA_REQUIRE_DEMO_MODEL=1: run scripts/get-demo-model.sh",
        path.display()
    );
    // Written past the test harness's capture, so the skip shows in every run.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: SmolLM2 tokenizer golden test: {} not found (run scripts/get-demo-model.sh)",
        path.display()
    );
    None
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let Some(path) = smollm2_gguf() else { return };
    let tok = from_gguf(&path);
    check("smollm2-gguf", &tok, &entry("smollm2-gguf"));
    assert!(!tok.add_bos_token());
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token_ids(), &[2]);
}

#[test]
fn decode_stream_never_splits_a_character() {
    let tok = Tokenizer::from_file(fixtures().join("tiny-spm")).unwrap();
    // Byte-fallback tokens of "東" (E6 9D B1), then "京" (E4 BA AC).
    let bytes = [0xE6u32, 0x9D, 0xB1, 0xE4, 0xBA, 0xAC];
    let ids: Vec<u32> = bytes
        .iter()
        .map(|b| tok.token_to_id(&format!("<0x{b:02X}>")).unwrap())
        .collect();
    let mut stream = tok.decode_stream(false);
    let pieces: Vec<Option<String>> = ids
        .iter()
        .map(|&id| stream.step(&tok, id).unwrap())
        .collect();
    assert_eq!(
        pieces,
        [None, None, Some("東".into()), None, None, Some("京".into())]
    );
    // An unfinished character comes out of `finish` as U+FFFD.
    let mut stream = tok.decode_stream(false);
    assert_eq!(stream.step(&tok, ids[0]).unwrap(), None);
    assert_eq!(stream.finish(&tok).unwrap().as_deref(), Some("\u{FFFD}"));
}
