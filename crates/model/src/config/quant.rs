//! `quantization_config` in `config.json`: which pre-quantized HuggingFace checkpoints
//! Tessera runs, and one refusal naming the key for any other.
//!
//! Runs: compressed-tensors FP8 (`quant_method: "compressed-tensors"`, format
//! `float-quantized` or `naive-quantized`), where every config group quantizes weights to
//! symmetric 8-bit floats (`type: float`, `num_bits: 8`) with one scale per tensor or per
//! output channel (`strategy: tensor | channel`). The tensors say the rest: each `F8_E4M3`
//! weight comes with its `weight_scale`, and modules in `ignore` stay in their float type
//! (`safetensors_source`). Input activations are not quantized, whether the checkpoint
//! names them dynamic (per token) or static (`input_scale`): the projections take f32
//! activations, as a weight-only FP8 (W8A16) kernel does.
//!
//! Refused: other methods (block-scaled `fp8`, GPTQ, AWQ, bitsandbytes, ...), other formats
//! (`pack-quantized` int4, ...), integer, group or block strategies, asymmetric or dynamic
//! weights, and a `kv_cache_scheme` (an FP8 KV cache with its scales).

use std::path::Path;

use serde_json::Value;

use super::refuse::unsupported;
use crate::error::ModelError;

/// What a `quantization_config` may be.
const SUPPORTED: &str = "compressed-tensors FP8 (float-quantized weights, num_bits 8, \
                         symmetric, strategy tensor or channel); for other quantized \
                         weights use a GGUF file";

/// Refuses a `quantization_config` other than compressed-tensors FP8 weights.
pub(super) fn check(path: &Path, q: &Value) -> Result<(), ModelError> {
    let refuse = |key: &str, found: String| {
        Err(unsupported(
            path,
            &format!("quantization_config.{key}"),
            found,
            SUPPORTED,
        ))
    };
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
    match text(q, "quant_method").as_deref() {
        Some("compressed-tensors") => {}
        other => return refuse("quant_method", other.unwrap_or("(none)").into()),
    }
    match text(q, "format").as_deref() {
        Some("float-quantized" | "naive-quantized") => {}
        other => return refuse("format", other.unwrap_or("(none)").into()),
    }
    if let Some(kv) = q.get("kv_cache_scheme").filter(|v| !v.is_null()) {
        return refuse("kv_cache_scheme", kv.to_string());
    }
    let groups = match q.get("config_groups").and_then(Value::as_object) {
        Some(groups) if !groups.is_empty() => groups,
        _ => return refuse("config_groups", "(none)".into()),
    };
    for (name, group) in groups {
        let Some(weights) = group.get("weights").filter(|w| !w.is_null()) else {
            return refuse(&format!("config_groups.{name}.weights"), "(none)".into());
        };
        let field = |key: &str| weights.get(key).filter(|v| !v.is_null());
        let wants: [(&str, &[Value]); 5] = [
            ("type", &[Value::from("float")]),
            ("num_bits", &[Value::from(8)]),
            ("strategy", &[Value::from("tensor"), Value::from("channel")]),
            ("symmetric", &[Value::from(true)]),
            ("dynamic", &[Value::from(false)]),
        ];
        for (key, allowed) in wants {
            // `symmetric` and `dynamic` may be left out (their defaults are allowed).
            let optional = matches!(key, "symmetric" | "dynamic");
            match field(key) {
                Some(v) if allowed.contains(v) => {}
                None if optional => {}
                found => {
                    let found = found.map_or_else(|| "(none)".into(), Value::to_string);
                    return refuse(&format!("config_groups.{name}.weights.{key}"), found);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fp8(strategy: &str) -> Value {
        json!({
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy,
                            "symmetric": true, "dynamic": false, "group_size": null},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                      "dynamic": true}
            }},
            "kv_cache_scheme": null
        })
    }

    fn refused_key(q: &Value) -> String {
        match check(Path::new("config.json"), q) {
            Err(ModelError::Unsupported { key, .. }) => key,
            other => panic!("{q}: {other:?}"),
        }
    }

    #[test]
    fn fp8_weights_by_tensor_or_channel_are_accepted() {
        for strategy in ["tensor", "channel"] {
            check(Path::new("config.json"), &fp8(strategy)).unwrap();
        }
    }

    #[test]
    fn everything_else_is_refused_naming_its_key() {
        let mut gptq = fp8("channel");
        gptq["quant_method"] = json!("gptq");
        assert_eq!(refused_key(&gptq), "quantization_config.quant_method");
        let mut packed = fp8("channel");
        packed["format"] = json!("pack-quantized");
        assert_eq!(refused_key(&packed), "quantization_config.format");
        let mut kv = fp8("tensor");
        kv["kv_cache_scheme"] = json!({"num_bits": 8, "type": "float"});
        assert_eq!(refused_key(&kv), "quantization_config.kv_cache_scheme");
        let weights = "quantization_config.config_groups.group_0.weights";
        for (key, value) in [
            ("type", json!("int")),
            ("num_bits", json!(4)),
            ("strategy", json!("block")),
            ("symmetric", json!(false)),
            ("dynamic", json!(true)),
        ] {
            let mut q = fp8("channel");
            q["config_groups"]["group_0"]["weights"][key] = value;
            assert_eq!(refused_key(&q), format!("{weights}.{key}"));
        }
        let mut none = fp8("tensor");
        none["config_groups"] = json!({});
        assert_eq!(refused_key(&none), "quantization_config.config_groups");
    }
}
