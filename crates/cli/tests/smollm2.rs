//! The real model, end to end through the `tessera` binary: SmolLM2-135M-Instruct (Q4_1 GGUF)
//! must give transformers' greedy tokens on three chat prompts
//! (`fixtures/smollm2/expected.json`, written by `scripts/fixtures/make_smollm2_reference.py`),
//! which covers the GGUF tokenizer, the chat template, the quantized kernels and the forward pass.
//!
//! The model is fetched by `scripts/get-demo-model.sh` into `models/`. Without it these tests
//! print SKIPPED, unless `TESSERA_REQUIRE_DEMO_MODEL=1` (set by `scripts/test.sh` and CI).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    prompts: Vec<ExpectedPrompt>,
}

#[derive(Deserialize)]
struct ExpectedPrompt {
    user_message: String,
    prompt_token_ids: Vec<u32>,
    generated_token_ids: Vec<u32>,
    generated_text: String,
}

#[derive(Deserialize)]
struct Output {
    prompt_token_ids: Vec<u32>,
    tokens: Vec<u32>,
    text: String,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The demo model's path, or `None` (after saying so) when it is absent and not required.
fn demo_model() -> Option<PathBuf> {
    let path = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    if std::env::var("TESSERA_REQUIRE_DEMO_MODEL").as_deref() == Ok("1") {
        panic!(
            "{} is missing; run scripts/get-demo-model.sh",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: {} is missing; run scripts/get-demo-model.sh",
        path.display()
    );
    None
}

fn generate_chat(model: &Path, message: &str, max_tokens: usize) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["generate", "--json", "--threads", "2", "--max-tokens"])
        .arg(max_tokens.to_string())
        .arg("--model")
        .arg(model)
        .args(["--chat", message])
        .output()
        .expect("tessera runs");
    assert!(
        out.status.success(),
        "tessera failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn greedy_chat_matches_transformers_and_knows_paris() {
    let Some(model) = demo_model() else { return };
    let text = std::fs::read_to_string(repo().join("fixtures/smollm2/expected.json")).unwrap();
    let expected: Expected = serde_json::from_str(&text).unwrap();
    assert_eq!(expected.prompts.len(), 3);
    for want in &expected.prompts {
        let got = generate_chat(&model, &want.user_message, 32);
        assert_eq!(
            got.prompt_token_ids, want.prompt_token_ids,
            "{:?}: prompt",
            want.user_message
        );
        // transformers stops at EOS and keeps it; so does tessera.
        assert_eq!(
            got.tokens, want.generated_token_ids,
            "{:?}: tokens",
            want.user_message
        );
        assert_eq!(
            got.text, want.generated_text,
            "{:?}: text",
            want.user_message
        );
    }
    let france = generate_chat(&model, "What is the capital of France?", 32);
    assert!(france.text.contains("Paris"), "answer: {:?}", france.text);
}
