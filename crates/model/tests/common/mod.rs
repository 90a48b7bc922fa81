//! What the model crate's golden tests share: the fixtures' `expected.json`, written by
//! `scripts/fixtures/make_model_fixtures.py` (transformers' float32 outputs for each
//! stored variant of each tiny model). Each test binary uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Deserialize)]
pub struct Expected {
    pub prompts: Vec<Vec<u32>>,
    pub variants: BTreeMap<String, Variant>,
}

#[derive(Deserialize)]
pub struct Variant {
    /// `None` for a reference whose weights are not stored (llama-kquant's f32).
    pub file: Option<String>,
    pub results: Vec<PromptResult>,
}

#[derive(Deserialize)]
pub struct PromptResult {
    pub last_logits: Vec<f32>,
    pub greedy: Vec<u32>,
    pub min_top2_margin: f32,
}

/// `fixtures/models`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models")
}

/// The `expected.json` of fixture `model`.
pub fn expected(model: &str) -> Expected {
    let path = fixtures().join(model).join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub mod twin;
