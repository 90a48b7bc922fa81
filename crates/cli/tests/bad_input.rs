//! Bad input to `tessera generate`: every case must exit non-zero with one clear error that
//! names the file and the tensor or key at fault — never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/models")
        .join(rel)
}

/// Runs `tessera generate --model MODEL --prompt-tokens 1,2,3` and returns stderr, checking
/// that it failed cleanly.
fn generate_fails(model: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "generate",
            "--prompt-tokens",
            "1,2,3",
            "--max-tokens",
            "2",
            "--model",
        ])
        .arg(model)
        .output()
        .expect("tessera runs");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit 1, stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(stderr.starts_with("error: "), "stderr: {stderr}");
    stderr
}

/// A copy of the f32 llama-gqa fixture directory to break.
fn copy_model_dir(tmp: &Path) -> PathBuf {
    copy_fixture_dir(tmp, "llama-gqa/f32")
}

/// A copy of the fixture directory `rel` to break.
fn copy_fixture_dir(tmp: &Path, rel: &str) -> PathBuf {
    let dir = tmp.join("model");
    std::fs::create_dir(&dir).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fixture(rel).join(name), dir.join(name)).unwrap();
    }
    dir
}

#[test]
fn missing_model_names_the_path() {
    let stderr = generate_fails(Path::new("/nonexistent/model.gguf"));
    assert!(stderr.contains("/nonexistent/model.gguf"), "{stderr}");
}

#[test]
fn truncated_safetensors_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_model_dir(tmp.path());
    let file = dir.join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let stderr = generate_fails(&dir);
    assert!(
        stderr.contains("model.safetensors") && stderr.contains("not a valid safetensors"),
        "{stderr}"
    );
}

#[test]
fn truncated_gguf_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("cut.gguf");
    let bytes = std::fs::read(fixture("llama-gqa/model.Q4_0.gguf")).unwrap();
    for cut in [10, bytes.len() / 3, bytes.len() - 1] {
        std::fs::write(&file, &bytes[..cut]).unwrap();
        let stderr = generate_fails(&file);
        assert!(stderr.contains("cut.gguf"), "cut at {cut}: {stderr}");
    }
}

#[test]
fn shape_that_disagrees_with_the_config_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_model_dir(tmp.path());
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = config.replace("\"intermediate_size\": 128", "\"intermediate_size\": 100");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let stderr = generate_fails(&dir);
    assert!(
        stderr.contains("model.layers.0.mlp.gate_proj.weight"),
        "{stderr}"
    );
    assert!(
        stderr.contains("[100, 64]") && stderr.contains("[128, 64]"),
        "{stderr}"
    );
}

#[test]
fn missing_config_key_names_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_model_dir(tmp.path());
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = config.replace("\"num_hidden_layers\": 2,", "");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let stderr = generate_fails(&dir);
    assert!(
        stderr.contains("config.json") && stderr.contains("num_hidden_layers"),
        "{stderr}"
    );
}

#[test]
fn unknown_quant_type_names_the_tensor_and_type() {
    // A GGUF v3 file by hand: no metadata, one tensor of GGML type 16 (IQ2_XXS, which Tessera does not
    // read), 256 values.
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&0u64.to_le_bytes()); // metadata entries
    let name = b"blk.0.ffn_up.weight";
    b.extend_from_slice(&(name.len() as u64).to_le_bytes());
    b.extend_from_slice(name);
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&256u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.resize(b.len().next_multiple_of(32) + 66, 0);
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("iq2.gguf");
    std::fs::write(&file, b).unwrap();
    let stderr = generate_fails(&file);
    assert!(
        stderr.contains("iq2.gguf") && stderr.contains("blk.0.ffn_up.weight"),
        "{stderr}"
    );
    assert!(stderr.contains("IQ2_XXS"), "{stderr}");
}

#[test]
fn token_outside_the_vocabulary_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "generate",
            "--prompt-tokens",
            "1,99999",
            "--max-tokens",
            "2",
            "--model",
        ])
        .arg(fixture("llama-gqa/f32"))
        .output()
        .expect("tessera runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("token id 99999") && stderr.contains("256"),
        "{stderr}"
    );
}

#[test]
fn text_prompt_without_tokenizer_says_what_to_do() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["generate", "--prompt", "hello", "--model"])
        .arg(fixture("llama-gqa/f32"))
        .output()
        .expect("tessera runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("--prompt-tokens"), "{stderr}");
}

/// A copy of llama-gqa whose `config.json` has `edit` applied, and the stderr of running it.
fn run_with_config(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    run_fixture_with_config("llama-gqa/f32", edit)
}

/// A copy of the fixture `rel` whose `config.json` has `edit` applied, and the stderr of
/// running it.
fn run_fixture_with_config(
    rel: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture_dir(tmp.path(), rel);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    generate_fails(&dir)
}

/// Each config feature Tessera cannot run gets one error naming config.json, the key, the
/// value found and what is supported (issue 18, part 5).
#[test]
fn unsupported_config_features_are_refused_by_name() {
    use serde_json::json;
    let cases: [(&str, serde_json::Value, &[&str]); 8] = [
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0}),
            &["type yarn", "default, linear, llama3"],
        ),
        (
            "num_local_experts",
            json!(8),
            &["= 8", "no mixture of experts"],
        ),
        (
            "n_routed_experts",
            json!(64),
            &["= 64", "no mixture of experts"],
        ),
        (
            "architectures",
            json!(["MixtralForCausalLM"]),
            &["MixtralForCausalLM", "LlamaForCausalLM, MistralForCausalLM"],
        ),
        (
            "model_type",
            json!("gemma3"),
            &["gemma3", "llama, mistral, qwen2, qwen3, gemma2"],
        ),
        (
            "hidden_act",
            json!("gelu"),
            &["= gelu ", "supported: silu, gelu_pytorch_tanh"],
        ),
        ("mlp_bias", json!(true), &["= true", "supported: false"]),
        ("num_experts", json!(4), &["= 4", "no mixture of experts"]),
    ];
    for (key, value, wanted) in cases {
        let stderr = run_with_config(|c| {
            c.insert(key.into(), value.clone());
        });
        assert!(
            stderr.contains("config.json") && stderr.contains(&format!("`{key}`")),
            "{key}: {stderr}"
        );
        assert!(
            stderr.contains("is not supported; supported: "),
            "{key}: {stderr}"
        );
        for w in wanted {
            assert!(stderr.contains(w), "{key}: {w:?} missing from {stderr}");
        }
        assert_eq!(stderr.lines().count(), 1, "{key}: one error, got {stderr}");
    }
}

/// A sliding window of no positions is refused by name (a window shorter than the context
/// is served: sliding-window attention, checked against transformers in the model tests).
#[test]
fn a_zero_sliding_window_is_refused() {
    let stderr = run_with_config(|c| {
        c.insert("model_type".into(), "mistral".into());
        c.insert(
            "architectures".into(),
            serde_json::json!(["MistralForCausalLM"]),
        );
        c.insert("sliding_window".into(), 0.into());
    });
    assert!(
        stderr.contains("`sliding_window` must be greater than 0"),
        "{stderr}"
    );
}

/// A `quantization_config` other than compressed-tensors FP8 weights by tensor or channel is
/// refused naming its key (the FP8 fixture's own config with one field changed, and the
/// block-scaled `fp8` method).
#[test]
fn quantization_configs_other_than_fp8_by_tensor_or_channel_are_refused() {
    use serde_json::json;
    let groups = "quantization_config.config_groups.group_0.weights";
    let cases = [
        (
            "/quant_method",
            json!("fp8"),
            "`quantization_config.quant_method` = fp8".to_string(),
        ),
        (
            "/config_groups/group_0/weights/strategy",
            json!("block"),
            format!("`{groups}.strategy` = \"block\""),
        ),
        (
            "/config_groups/group_0/weights/num_bits",
            json!(4),
            format!("`{groups}.num_bits` = 4"),
        ),
    ];
    for (pointer, value, wanted) in cases {
        let stderr = run_fixture_with_config("llama-fp8/fp8-channel", |c| {
            *c["quantization_config"].pointer_mut(pointer).unwrap() = value;
        });
        assert!(stderr.contains(&wanted), "{wanted:?} missing from {stderr}");
        assert!(
            stderr.contains("supported: compressed-tensors FP8"),
            "{stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "one error, got {stderr}");
    }
}

/// Phi-3's fused q|k|v and gate|up must hold exactly the rows the config's parts add up
/// to; LongRoPE needs one factor per frequency; other rope types and a partial rotation
/// are refused by name.
#[test]
fn phi3_fused_tensors_and_longrope_are_checked_against_the_config() {
    use serde_json::json;
    type Edit = fn(&mut serde_json::Map<String, serde_json::Value>);
    let cases: [(Edit, &[&str]); 5] = [
        (
            |c| drop(c.insert("num_key_value_heads".into(), 1.into())),
            &[
                "fused tensor `model.layers.0.self_attn.qkv_proj.weight` has 128 rows",
                "q + k + v = 64 + 16 + 16 add up to 96",
            ],
        ),
        (
            |c| drop(c.insert("intermediate_size".into(), 24.into())),
            &[
                "fused tensor `model.layers.0.mlp.gate_up_proj.weight` has 64 rows",
                "gate + up = 24 + 24 add up to 48",
            ],
        ),
        (
            |c| c["rope_parameters"]["short_factor"] = json!([1.0, 1.0, 1.0]),
            &[
                "config.json: `rope_scaling` `short_factor` has 3 values; a head of 16 has 8 frequencies",
            ],
        ),
        (
            |c| c["rope_parameters"]["rope_type"] = json!("dynamic"),
            &[
                "`rope_scaling` = type dynamic is not supported; supported: default, linear, llama3, longrope",
            ],
        ),
        (
            |c| c["rope_parameters"]["partial_rotary_factor"] = json!(0.5),
            &["`partial_rotary_factor` = 0.5 is not supported"],
        ),
    ];
    for (edit, wanted) in cases {
        let stderr = run_fixture_with_config("phi3/f32", edit);
        for want in wanted {
            assert!(stderr.contains(want), "{want:?} missing from {stderr}");
        }
    }
}
