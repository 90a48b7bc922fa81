use super::*;

/// A decode step of one tp = 1 rank with bf16 weights: Llama (no bias) or Qwen2 (q/k/v
/// bias), with the grouped attention kernel unsplit unless `split`.
fn decode(path: KernelPath, qkv_bias: bool, grouped: bool, split: bool) -> LayerShape {
    LayerShape {
        path,
        biases: Biases {
            q: qkv_bias,
            k: qkv_bias,
            v: qkv_bias,
            ..Biases::default()
        },
        f32_hidden: false,
        f32_activation: false,
        grouped_attention: grouped,
        attention_split: split || !grouped,
        tensor_parallel: false,
        decode: true,
        gemm: Gemm::Cublas,
        qk_norm: false,
        exact: false,
    }
}

#[test]
fn the_exact_path_is_the_legacy_one_without_a_rounding() {
    for path in KernelPath::ALL {
        let mut shape = decode(path, true, false, true);
        shape.exact = true;
        let plan = layer_launches(&shape);
        assert!(
            !plan.iter().any(|l| matches!(l, Launch::RoundBf16(_))),
            "{path}"
        );
        let mut legacy: Vec<Launch> =
            layer_launches(&decode(KernelPath::Legacy, true, false, true));
        legacy.retain(|l| !matches!(l, Launch::RoundBf16(_)));
        assert_eq!(plan, legacy, "{path}");
        // Four roundings fewer than the bf16 legacy layer's 20 (Qwen2's q/k/v biases).
        assert_eq!(kernels_per_layer(&plan), 16, "{path}");
    }
}

#[test]
fn a_qk_norm_model_runs_the_legacy_path_with_the_norm_before_rope() {
    assert_eq!(KernelPath::Fused.serving(true), KernelPath::Legacy);
    assert_eq!(KernelPath::Fused.serving(false), KernelPath::Fused);
    for path in KernelPath::ALL {
        let mut shape = decode(path, false, true, false);
        shape.qk_norm = true;
        let plan = layer_launches(&shape);
        let legacy = layer_launches(&decode(KernelPath::Legacy, false, true, false));
        assert!(!plan.iter().any(|l| matches!(l, Launch::RopeKvWrite { .. })));
        assert!(!plan.contains(&Launch::Project(Proj::Qkv, Gemm::Cublas)));
        let at = |plan: &[Launch], l: Launch| plan.iter().position(|x| *x == l).unwrap();
        assert_eq!(
            at(&plan, Launch::QkNorm) + 1,
            at(&plan, Launch::Rope),
            "{path}"
        );
        assert!(at(&plan, Launch::Project(Proj::K, Gemm::Cublas)) < at(&plan, Launch::QkNorm));
        assert_eq!(
            kernels_per_layer(&plan),
            kernels_per_layer(&legacy) + 2,
            "{path}"
        );
    }
}

#[test]
fn a_fused_decode_layer_launches_at_most_eight_kernels() {
    for (model, bias) in [("llama", false), ("qwen2", true)] {
        let legacy = kernels_per_layer(&layer_launches(&decode(
            KernelPath::Legacy,
            bias,
            false,
            true,
        )));
        let fused = kernels_per_layer(&layer_launches(&decode(
            KernelPath::Fused,
            bias,
            true,
            false,
        )));
        let fused_split = kernels_per_layer(&layer_launches(&decode(
            KernelPath::Fused,
            bias,
            true,
            true,
        )));
        eprintln!(
            "{model}: legacy {legacy} launches a layer, fused {fused} (grouped attention \
             unsplit), {fused_split} (split)"
        );
        assert!(fused <= 8, "{model}: {fused} launches a fused layer");
        assert_eq!(fused_split, fused + 1, "{model}: a split adds the reduce");
        assert!(legacy > fused, "{model}");
    }
}

#[test]
fn prefill_and_the_legacy_attention_keep_the_separate_rope_kv_write() {
    let mut shape = decode(KernelPath::Fused, true, true, false);
    shape.decode = false;
    let plan = layer_launches(&shape);
    assert!(plan.contains(&Launch::RopeKvWrite { bias: true }));
    assert_eq!(kernels_per_layer(&plan), 9);
    let legacy_attention = layer_launches(&decode(KernelPath::Fused, false, false, true));
    assert!(legacy_attention.contains(&Launch::RopeKvWrite { bias: false }));
    assert!(legacy_attention.contains(&Launch::RoundBf16(Rounded::Attention)));
    // Every projection of a fused layer is a GEMM of its own, q|k|v one of them.
    let projections = |plan: &[Launch]| {
        plan.iter()
            .filter(|l| matches!(l, Launch::Project(..)))
            .count()
    };
    assert_eq!(projections(&plan), 4);
    assert_eq!(
        projections(&layer_launches(&decode(
            KernelPath::Legacy,
            false,
            true,
            false
        ))),
        6
    );
}

#[test]
fn tensor_parallel_layers_sum_both_row_parallel_outputs() {
    let mut shape = decode(KernelPath::Fused, false, true, false);
    shape.tensor_parallel = true;
    let plan = layer_launches(&shape);
    assert_eq!(plan.iter().filter(|l| **l == Launch::AllReduce).count(), 2);
    // A collective is not a kernel of `Ops`.
    assert_eq!(kernels_per_layer(&plan), 8);
}

#[test]
fn the_gemv_replaces_each_gemm_launch_for_launch() {
    for path in KernelPath::ALL {
        for (grouped, split, decoding) in [
            (false, true, true),
            (true, false, true),
            (true, true, false),
        ] {
            let mut shape = decode(path, true, grouped, split);
            shape.decode = decoding;
            let gemm = layer_launches(&shape);
            shape.gemm = Gemm::Gemv;
            let gemv = layer_launches(&shape);
            assert_eq!(kernels_per_layer(&gemv), kernels_per_layer(&gemm), "{path}");
            assert_eq!(gemv.len(), gemm.len());
            for (a, b) in gemm.iter().zip(&gemv) {
                match (a, b) {
                    (Launch::Project(p, Gemm::Cublas), Launch::Project(q, Gemm::Gemv)) => {
                        assert_eq!(p, q)
                    }
                    _ => assert_eq!(a, b, "{path}: only projections change"),
                }
            }
            assert!(gemv.iter().any(|l| l.name() == "projection (bf16 GEMV)"));
        }
    }
}

#[test]
fn the_gemv_serves_batches_of_one_to_eight_tokens() {
    for tokens in 1..=GEMV_MAX_TOKENS {
        assert_eq!(Gemm::Gemv.for_tokens(tokens), Gemm::Gemv);
        assert_eq!(Gemm::Cublas.for_tokens(tokens), Gemm::Cublas);
    }
    for tokens in [0, GEMV_MAX_TOKENS + 1, 64, 256] {
        assert_eq!(Gemm::Gemv.for_tokens(tokens), Gemm::Cublas, "{tokens}");
    }
}

#[test]
fn the_gemv_env_value_names_a_choice() {
    assert_eq!(Gemm::from_env_value(None).unwrap(), Gemm::Cublas);
    assert_eq!(Gemm::from_env_value(Some("")).unwrap(), Gemm::Cublas);
    assert_eq!(Gemm::from_env_value(Some("0")).unwrap(), Gemm::Cublas);
    assert_eq!(Gemm::from_env_value(Some("1")).unwrap(), Gemm::Gemv);
    let err = Gemm::from_env_value(Some("on")).unwrap_err().to_string();
    assert!(
        err.contains("`on`")
            && err.contains("TESSERA_GEMV")
            && err.contains("0")
            && err.contains("1"),
        "{err}"
    );
}

#[test]
fn the_env_value_names_a_path() {
    assert_eq!(
        KernelPath::from_env_value(None).unwrap(),
        KernelPath::Legacy
    );
    assert_eq!(
        KernelPath::from_env_value(Some("")).unwrap(),
        KernelPath::Legacy
    );
    assert_eq!(
        KernelPath::from_env_value(Some("1")).unwrap(),
        KernelPath::Fused
    );
    assert_eq!(
        KernelPath::from_env_value(Some("0")).unwrap(),
        KernelPath::Legacy
    );
    let err = KernelPath::from_env_value(Some("yes"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("yes") && err.contains("TESSERA_FUSED"),
        "{err}"
    );
}
