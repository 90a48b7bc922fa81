//! GGUF metadata that asks for what Tessera cannot run — a mixture of experts, an unknown
//! architecture, a rope scaling type other than linear, RoPE over part of each head — is
//! refused with one error naming the file, the key and what is supported; a sliding window
//! slides every layer (issue 18, part 5); Phi-3's LongRoPE factors must fit its heads, and
//! its fused tensors the config's parts. Config.json features are covered end to end in
//! `crates/cli/tests/bad_input.rs`.

mod gguf_writer;

use gguf_writer::*;
use tessera_kernels::DType;
use tessera_model::config::ModelConfig;
use tessera_model::error::ModelError;
use tessera_model::gguf::GgufFile;

/// The smallest llama GGUF `ModelConfig::from_gguf` accepts, under architecture `arch`.
fn llama(arch: &str) -> Gguf {
    let key = |k: &str| format!("{arch}.{k}");
    Gguf::new()
        .kv_str("general.architecture", arch)
        .kv_u32(&key("embedding_length"), 64)
        .kv_u32(&key("attention.head_count"), 4)
        .kv_u32(&key("feed_forward_length"), 128)
        .kv_u32(&key("block_count"), 1)
        .kv_u32(&key("context_length"), 128)
        .tensor("token_embd.weight", &[64, 8], DType::F32)
}

fn config(g: Gguf) -> (Scratch, Result<ModelConfig, ModelError>) {
    let s = scratch();
    std::fs::write(&s.path, g.bytes()).unwrap();
    let file = GgufFile::open(&s.path).unwrap();
    let config = ModelConfig::from_gguf(&file);
    (s, config)
}

/// Expects an `Unsupported` error naming the file and each of `names`.
fn refused(g: Gguf, names: &[&str]) {
    let (s, config) = config(g);
    let err = config.expect_err("unsupported file accepted");
    assert!(matches!(err, ModelError::Unsupported { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with(&s.path.display().to_string()), "{msg}");
    assert!(msg.contains("is not supported; supported: "), "{msg}");
    for name in names {
        assert!(msg.contains(name), "{name:?} missing from: {msg}");
    }
}

#[test]
fn the_base_file_is_accepted() {
    let config = config(llama("llama").kv_u32("llama.expert_count", 0))
        .1
        .unwrap();
    assert_eq!(config.max_position_embeddings, 128);
    assert_eq!(config.vocab_size, 8);
}

#[test]
fn experts_are_refused() {
    refused(
        llama("llama").kv_u32("llama.expert_count", 8),
        &["`llama.expert_count` = 8", "no mixture of experts"],
    );
}

#[test]
fn unknown_architecture_is_refused() {
    refused(
        llama("gemma3"),
        &[
            "`general.architecture` = gemma3",
            "llama, mistral, qwen2, qwen3, gemma2",
        ],
    );
}

#[test]
fn rope_scaling_types_other_than_linear_are_refused() {
    for kind in ["yarn", "longrope"] {
        refused(
            llama("llama").kv_str("llama.rope.scaling.type", kind),
            &["`llama.rope.scaling.type`", kind, "none, linear"],
        );
    }
    let none = llama("llama").kv_str("llama.rope.scaling.type", "none");
    assert!(config(none).1.is_ok());
}

/// A GGUF sliding window slides every layer and keeps the context.
#[test]
fn a_sliding_window_slides_every_layer() {
    let g = llama("llama").kv_u32("llama.attention.sliding_window", 16);
    let c = config(g).1.unwrap();
    assert_eq!(c.max_position_embeddings, 128);
    assert_eq!(c.block.windows, vec![Some(16); c.num_hidden_layers]);
    let none = config(llama("llama")).1.unwrap();
    assert_eq!(none.block.windows, vec![None; none.num_hidden_layers]);
}

/// A phi3 file with LongRoPE as llama.cpp's converter writes it (factor tensors of
/// `head_dim / 2` values, the original context), with `edit` applied.
fn phi3(edit: impl FnOnce(Gguf) -> Gguf, factors: u64) -> Gguf {
    let g = llama("phi3")
        .kv_u32("phi3.rope.dimension_count", 16)
        .tensor("rope_factors_long.weight", &[factors], DType::F32)
        .tensor("rope_factors_short.weight", &[factors], DType::F32);
    edit(g)
}

#[test]
fn phi3_longrope_metadata_is_read_or_refused_by_name() {
    use tessera_kernels::rope::RopeScaling;
    let ctx = |g: Gguf| g.kv_u32("phi3.rope.scaling.original_context_length", 32);
    let c = config(phi3(ctx, 8)).1.unwrap();
    let RopeScaling::LongRope(l) = &c.rope.scaling else {
        panic!("not LongRoPE: {:?}", c.rope.scaling);
    };
    // No attn_factor key: √(1 + ln(128 / 32) / ln 32).
    assert_eq!(l.original_max_position_embeddings, 32);
    assert!((l.attention_factor - 1.4f32.sqrt()).abs() < 1e-6);
    assert_eq!(l.long_factor.len(), 8);
    let (_, short) = config(phi3(ctx, 4));
    let msg = short.unwrap_err().to_string();
    assert!(
        msg.contains("`rope_factors_short.weight` has 4 values; a head of 16 has 8 frequencies"),
        "{msg}"
    );
    let (_, no_ctx) = config(phi3(|g| g, 8));
    let msg = no_ctx.unwrap_err().to_string();
    assert!(
        msg.contains("missing key `phi3.rope.scaling.original_context_length`"),
        "{msg}"
    );
    refused(
        llama("phi3").kv_u32("phi3.rope.dimension_count", 8),
        &["`phi3.rope.dimension_count` = 8", "the head dimension, 16"],
    );
}

/// A whole one-layer phi3 file (plain RoPE; 4 heads of 16, as many KV heads) whose fused
/// `attn_qkv` holds `qkv_rows` rows and fused `ffn_up` (gate | up) `gate_up_rows`.
fn phi3_weights(qkv_rows: u64, gate_up_rows: u64) -> Gguf {
    llama("phi3")
        .tensor("output_norm.weight", &[64], DType::F32)
        .tensor("blk.0.attn_norm.weight", &[64], DType::F32)
        .tensor("blk.0.attn_qkv.weight", &[64, qkv_rows], DType::F32)
        .tensor("blk.0.attn_output.weight", &[64, 64], DType::F32)
        .tensor("blk.0.ffn_norm.weight", &[64], DType::F32)
        .tensor("blk.0.ffn_up.weight", &[64, gate_up_rows], DType::F32)
        .tensor("blk.0.ffn_down.weight", &[128, 64], DType::F32)
}

/// A fused tensor whose rows are not its parts' sum is one `FusedRows` error naming it;
/// the same file with the right rows loads.
#[test]
fn phi3_fused_gguf_tensors_must_hold_their_parts() {
    let load = |g: Gguf| {
        let s = scratch();
        std::fs::write(&s.path, g.bytes()).unwrap();
        let loaded = tessera_model::loader::load_weights(&s.path);
        (s, loaded.map(|_| ()))
    };
    load(phi3_weights(192, 256)).1.unwrap();
    for (g, wanted) in [
        (
            phi3_weights(128, 256),
            "`blk.0.attn_qkv.weight` has 128 rows",
        ),
        (phi3_weights(192, 200), "`blk.0.ffn_up.weight` has 200 rows"),
    ] {
        let (_s, loaded) = load(g);
        let err = loaded.expect_err("a fused tensor of the wrong rows loaded");
        assert!(matches!(err, ModelError::FusedRows { .. }), "{err}");
        assert!(
            err.to_string().contains(wanted),
            "{wanted:?} missing from {err}"
        );
    }
}
