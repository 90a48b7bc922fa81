//! The kernel launches of one decoder layer on a CUDA device, as a list: the CUDA pass
//! (`cuda::CudaLlama`, feature `cuda`) runs exactly this list, launch by launch, and checks
//! after each that the kernels it launched are the count the list says
//! ([`Launch::kernels`]), so a count taken here, without a GPU, is the count of the real
//! launch sequence.
//!
//! Two paths ([`KernelPath`], chosen by `TESSERA_FUSED` in the shard):
//! - [`KernelPath::Legacy`] (the default until the fused kernels have run on a GPU):
//!   separate q, k and v GEMMs, each bias its own launch, RoPE, the KV write, and a
//!   `round_bf16` before every GEMM — 17 launches a layer for Llama at decode.
//! - [`KernelPath::Fused`] (issue 16): q|k|v stacked into one GEMM at upload, the residual
//!   add + RMSNorm writing the GEMM's bf16 input, RoPE with the q/k/v bias and the KV
//!   write in one kernel (`rope_kv_write`), the grouped attention writing the o
//!   projection's bf16 input, and SiLU·mul writing bf16. At decode with the grouped
//!   attention kernel, `rope_kv_write`'s work moves into the attention launch itself (its
//!   append mode), so a layer is 8 launches (Llama and Qwen2 alike) when the attention
//!   runs unsplit, 9 when it splits along the context (its reduce).
//!
//! A model with per-head q/k norms (Qwen3) runs the legacy path whatever `TESSERA_FUSED`
//! says ([`KernelPath::serving`]): `rope_kv_write` and the attention's append rotate the
//! projection's output directly, with no place for the norm. Its legacy layer adds one
//! [`Launch::QkNorm`] (two `rmsnorm_residual_f32` launches over rows of `head_dim`).
//!
//! On either path a bf16 projection is one launch of the kernel [`Gemm`] names: cuBLAS,
//! or with `TESSERA_GEMV=1` and a batch of at most [`GEMV_MAX_TOKENS`] tokens the GEMV of
//! `gemv.cu` — one launch for one, so the counts do not change.

use tessera_kernels::DType;

/// Whether a cuda shard keeps weights of `dtype` as stored (a matvec kernel reads them,
/// with f32 rows); it holds every other matrix in bf16.
pub fn device_keeps_quantized(dtype: DType) -> bool {
    dtype.cuda_matvec().is_some()
}

/// Which launch sequence a layer runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelPath {
    /// The launches the CUDA model ran first (`TESSERA_FUSED=0` or unset).
    #[default]
    Legacy,
    /// The fused kernels (`TESSERA_FUSED=1`); not run on a GPU yet.
    Fused,
}

impl KernelPath {
    pub const ALL: [KernelPath; 2] = [KernelPath::Legacy, KernelPath::Fused];

    /// What `TESSERA_FUSED` says for this path: `0` or `1`.
    pub fn env_value(self) -> &'static str {
        match self {
            KernelPath::Legacy => "0",
            KernelPath::Fused => "1",
        }
    }

    /// The path a model runs when this one is asked for: the legacy one for a model with
    /// per-head q/k norms (`qk_norm`), which the fused kernels do not apply.
    pub fn serving(self, qk_norm: bool) -> KernelPath {
        if qk_norm { KernelPath::Legacy } else { self }
    }

    /// The path a `TESSERA_FUSED` value names; unset or empty is the default.
    pub fn from_env_value(value: Option<&str>) -> Result<KernelPath, crate::error::ModelError> {
        switch_value(&KernelPath::ALL, KernelPath::env_value, value)
            .map_err(|name| crate::error::ModelError::UnknownKernelPath { name })
    }
}

/// The choice among `all` whose `env_value` is `value` (a switch read from the
/// environment once, at upload); unset or empty is the default. Err: the value, which
/// names none.
fn switch_value<T: Copy + Default>(
    all: &[T],
    env_value: fn(T) -> &'static str,
    value: Option<&str>,
) -> Result<T, String> {
    match value {
        None | Some("") => Ok(T::default()),
        Some(v) => all
            .iter()
            .copied()
            .find(|&c| env_value(c) == v)
            .ok_or_else(|| v.to_string()),
    }
}

/// The most tokens the bf16 GEMV serves (`tessera_kernels::cuda::GEMV_MAX_TOKENS`, which
/// the CUDA model checks it equals): a batch of more is a GEMM.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Which kernel runs a bf16 projection (a quantized one the device keeps runs its dequantizing matvec
/// either way): cuBLAS's GEMM, or for a batch of at most [`GEMV_MAX_TOKENS`] tokens the
/// GEMV of `gemv.cu`, which reads each weight byte once for the whole batch. Chosen by
/// `TESSERA_GEMV`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Gemm {
    /// `cublasGemmEx` (`TESSERA_GEMV=0` or unset): the default until the GEMV has run on
    /// a GPU.
    #[default]
    Cublas,
    /// `gemv_bf16_t{tokens}` (`TESSERA_GEMV=1`); not run on a GPU yet.
    Gemv,
}

impl Gemm {
    pub const ALL: [Gemm; 2] = [Gemm::Cublas, Gemm::Gemv];

    /// What `TESSERA_GEMV` says for this choice: `0` or `1`.
    pub fn env_value(self) -> &'static str {
        match self {
            Gemm::Cublas => "0",
            Gemm::Gemv => "1",
        }
    }

    /// The choice a `TESSERA_GEMV` value names; unset or empty is the default.
    pub fn from_env_value(value: Option<&str>) -> Result<Gemm, crate::error::ModelError> {
        switch_value(&Gemm::ALL, Gemm::env_value, value)
            .map_err(|name| crate::error::ModelError::UnknownGemm { name })
    }

    /// The kernel that runs a pass of `tokens` tokens under this choice: the GEMV serves
    /// only batches of 1 to [`GEMV_MAX_TOKENS`].
    pub fn for_tokens(self, tokens: usize) -> Gemm {
        match self {
            Gemm::Gemv if (1..=GEMV_MAX_TOKENS).contains(&tokens) => Gemm::Gemv,
            _ => Gemm::Cublas,
        }
    }
}

impl std::fmt::Display for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Gemm::Cublas => "cublas",
            Gemm::Gemv => "gemv",
        })
    }
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelPath::Legacy => "legacy",
            KernelPath::Fused => "fused",
        })
    }
}

/// The two RMSNorms of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// Before attention; it first adds the previous layer's pending row-parallel output.
    Attention,
    /// Before the MLP; it first adds the o projection's output.
    Mlp,
}

/// A layer's projections: q, k and v separately (legacy) or stacked (fused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    Q,
    K,
    V,
    Qkv,
    O,
    GateUp,
    Down,
}

/// The activations `round_bf16` rounds for a GEMM's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounded {
    /// The normed rows (q/k/v or gate|up read them).
    Hidden,
    /// The attention output (o reads it).
    Attention,
    /// SiLU·mul's output (down reads it).
    Activation,
}

/// One step of a layer: one kernel launch (a cuBLAS call counts one), two for an attention
/// that splits, none for the all-reduce (a collective, not a kernel of `Ops`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// `rmsnorm_residual_f32`: the residual add and the norm, in f32.
    Norm(Norm),
    /// `rmsnorm_residual_bf16`: the same, writing the GEMM's bf16 input; the f32 rows too
    /// when a quantized matvec reads them.
    NormBf16 { norm: Norm, f32_out: bool },
    /// `round_bf16`.
    RoundBf16(Rounded),
    /// A projection: bf16 weights through the kernel [`Gemm`] names (cuBLAS, or the GEMV
    /// of a small batch), f32 ones (the exact path) through cuBLAS's f32 GEMM, and the
    /// types the device keeps quantized through their dequantizing matvec.
    Project(Proj, Gemm),
    /// `add_bias_f32` on a projection's output.
    AddBias(Proj),
    /// Qwen3's per-head RMSNorm: `rmsnorm_residual_f32` (no residual add) over the rows of
    /// `head_dim` of the q projection, then of the k projection, into q and k.
    QkNorm,
    /// `rope_f32` on q and k.
    Rope,
    /// `kv_write_bf16` (`kv_write_f32` on the exact path).
    KvWrite,
    /// `rope_kv_write`: the q/k/v bias (when `bias`), RoPE and the KV write.
    RopeKvWrite { bias: bool },
    /// Paged attention; `bf16_out`: the grouped kernel writes the o projection's bf16
    /// input too; `reduce`: a second launch merges the partitions; `append`: the grouped
    /// kernel does `rope_kv_write`'s work first (decode only), with the bias when `bias`.
    Attention {
        bf16_out: bool,
        reduce: bool,
        append: bool,
        bias: bool,
    },
    /// `silu_mul_f32`.
    SiluMul,
    /// `silu_mul_bf16`; the f32 values too when a quantized matvec reads them.
    SiluMulBf16 { f32_out: bool },
    /// The sum of the row-parallel output over the group (tp > 1).
    AllReduce,
}

impl Launch {
    /// Kernels this step launches through `Ops`.
    pub fn kernels(&self) -> u64 {
        match self {
            Launch::Attention { reduce, .. } => 1 + u64::from(*reduce),
            Launch::AllReduce => 0,
            Launch::QkNorm => 2,
            _ => 1,
        }
    }

    /// A name for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Launch::Norm(_) => "rmsnorm_residual_f32",
            Launch::NormBf16 { .. } => "rmsnorm_residual_bf16",
            Launch::RoundBf16(_) => "round_bf16",
            Launch::Project(_, Gemm::Cublas) => "projection (cuBLAS GEMM)",
            Launch::Project(_, Gemm::Gemv) => "projection (bf16 GEMV)",
            Launch::AddBias(_) => "add_bias_f32",
            Launch::QkNorm => "rmsnorm_residual_f32 (q/k heads)",
            Launch::Rope => "rope_f32",
            Launch::KvWrite => "kv_write",
            Launch::RopeKvWrite { .. } => "rope_kv_write",
            Launch::Attention { .. } => "paged attention",
            Launch::SiluMul => "silu_mul_f32",
            Launch::SiluMulBf16 { .. } => "silu_mul_bf16",
            Launch::AllReduce => "all-reduce",
        }
    }
}

/// Which projections carry a bias.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Biases {
    /// q, k and v (all three in Qwen2).
    pub q: bool,
    pub k: bool,
    pub v: bool,
    pub o: bool,
    pub gate_up: bool,
    pub down: bool,
}

/// What decides a layer's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub path: KernelPath,
    pub biases: Biases,
    /// A projection reading the normed rows (q/k/v or gate|up) is a quantized matvec,
    /// which reads f32 rows.
    pub f32_hidden: bool,
    /// The down projection is a quantized matvec.
    pub f32_activation: bool,
    /// The paged-attention kernel is the grouped one, or the flash one, which serves no
    /// decode step (both can write bf16).
    pub grouped_attention: bool,
    /// The attention splits along the context (a reduce launch follows): always for the
    /// legacy kernel, when the batch does not fill the device for the grouped one.
    pub attention_split: bool,
    /// More than one rank: the row-parallel outputs are summed over the group.
    pub tensor_parallel: bool,
    /// Every query is the one new token of its sequence (a decode step).
    pub decode: bool,
    /// The kernel of the bf16 projections of this pass ([`Gemm::for_tokens`]).
    pub gemm: Gemm,
    /// Every q and k head is RMS-normalized before RoPE (Qwen3): the legacy path runs.
    pub qk_norm: bool,
    /// The exact path (`dtype = "f32"`): every projection is an f32 GEMM reading f32 rows,
    /// so nothing is rounded to bf16, and the legacy path runs.
    pub exact: bool,
}

impl Biases {
    /// Any of q, k and v: the stacked projection's bias (zeros where a part has none).
    pub fn qkv(&self) -> bool {
        self.q || self.k || self.v
    }
}

/// The launches of one layer, in order.
pub fn layer_launches(shape: &LayerShape) -> Vec<Launch> {
    let mut plan = Vec::with_capacity(24);
    let bias = |plan: &mut Vec<Launch>, on: bool, p: Proj| {
        if on {
            plan.push(Launch::AddBias(p));
        }
    };
    let b = shape.biases;
    let fused = !shape.exact && shape.path.serving(shape.qk_norm) == KernelPath::Fused;
    let round = |plan: &mut Vec<Launch>, r: Rounded| {
        if !shape.exact {
            plan.push(Launch::RoundBf16(r));
        }
    };
    let append = fused && shape.grouped_attention && shape.decode;
    // Attention's half.
    if fused {
        plan.push(Launch::NormBf16 {
            norm: Norm::Attention,
            f32_out: shape.f32_hidden,
        });
        plan.push(Launch::Project(Proj::Qkv, shape.gemm));
        if !append {
            plan.push(Launch::RopeKvWrite { bias: b.qkv() });
        }
    } else {
        plan.push(Launch::Norm(Norm::Attention));
        round(&mut plan, Rounded::Hidden);
        for (p, on) in [(Proj::Q, b.q), (Proj::K, b.k), (Proj::V, b.v)] {
            plan.push(Launch::Project(p, shape.gemm));
            bias(&mut plan, on, p);
        }
        if shape.qk_norm {
            plan.push(Launch::QkNorm);
        }
        plan.push(Launch::Rope);
        plan.push(Launch::KvWrite);
    }
    let bf16_out = fused && shape.grouped_attention;
    plan.push(Launch::Attention {
        bf16_out,
        reduce: shape.attention_split,
        append,
        bias: append && b.qkv(),
    });
    if !bf16_out {
        round(&mut plan, Rounded::Attention);
    }
    plan.push(Launch::Project(Proj::O, shape.gemm));
    bias(&mut plan, b.o, Proj::O);
    if shape.tensor_parallel {
        plan.push(Launch::AllReduce);
    }
    // The MLP's half.
    if fused {
        plan.push(Launch::NormBf16 {
            norm: Norm::Mlp,
            f32_out: shape.f32_hidden,
        });
    } else {
        plan.push(Launch::Norm(Norm::Mlp));
        round(&mut plan, Rounded::Hidden);
    }
    plan.push(Launch::Project(Proj::GateUp, shape.gemm));
    bias(&mut plan, b.gate_up, Proj::GateUp);
    if fused {
        plan.push(Launch::SiluMulBf16 {
            f32_out: shape.f32_activation,
        });
    } else {
        plan.push(Launch::SiluMul);
        round(&mut plan, Rounded::Activation);
    }
    plan.push(Launch::Project(Proj::Down, shape.gemm));
    bias(&mut plan, b.down, Proj::Down);
    if shape.tensor_parallel {
        plan.push(Launch::AllReduce);
    }
    plan
}

/// Kernels launched by one layer of `plan`.
pub fn kernels_per_layer(plan: &[Launch]) -> u64 {
    plan.iter().map(Launch::kernels).sum()
}

#[cfg(test)]
mod tests;
