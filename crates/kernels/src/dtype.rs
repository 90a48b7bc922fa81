//! Element types of weight tensors, including GGML's block-quantized formats.
//!
//! A quantized row is a sequence of fixed-size blocks; each block packs `block_elems()`
//! values into `block_bytes()` bytes. Float types are blocks of one element. Every type but
//! [`DType::F8E4M3`] is a GGML type, as GGUF files store it.

use crate::error::KernelError;

/// The storage type of a weight tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 values: f16 scale `d`, 32 × i8. `x = d·q`.
    Q8_0,
    /// 32 values: f16 scale `d`, 16 bytes of nibbles. `x = d·(q − 8)`.
    Q4_0,
    /// 32 values: f16 scale `d`, f16 min `m`, 16 bytes of nibbles. `x = d·q + m`.
    Q4_1,
    /// 256 values in 8 sub-blocks of 32, 6-bit sub-scales and mins, 4-bit quants.
    Q4K,
    /// 256 values in 16 sub-blocks of 16, 8-bit sub-scales, 6-bit quants.
    Q6K,
    /// 32 values: f16 scale `d`, 32 high bits, 16 bytes of nibbles. `x = d·(q − 16)`.
    Q5_0,
    /// 32 values: f16 scale `d`, f16 min `m`, 32 high bits, 16 bytes of nibbles.
    /// `x = d·q + m`.
    Q5_1,
    /// 256 values in 8 sub-blocks of 32, 6-bit sub-scales and mins, 5-bit quants.
    Q5K,
    /// 256 values in 16 sub-blocks of 16, 6-bit signed sub-scales, 3-bit quants.
    Q3K,
    /// 256 values in 16 sub-blocks of 16, 4-bit sub-scales and mins, 2-bit quants.
    Q2K,
    /// 32 values: f16 scale `d`, 16 bytes of nibbles indexing a fixed non-linear table.
    IQ4NL,
    /// 256 values in 8 sub-blocks of 32, 6-bit signed sub-scales, nibbles indexing the
    /// IQ4_NL table.
    IQ4XS,
    /// 32 values: f32 scale `s`, 32 × float8 e4m3fn. `x = s·q`. Not a GGML type: how
    /// Tessera holds the FP8 weights of a HuggingFace checkpoint (compressed-tensors), the
    /// tensor's or the row's scale beside every 32 values (`quant::fp8`).
    F8E4M3,
}

impl DType {
    /// Every type: the GGML types, then FP8. Useful for tests that cover them all.
    pub const ALL: [DType; 16] = {
        let mut all = [DType::F8E4M3; 16];
        let mut i = 0;
        while i < DType::GGML.len() {
            all[i] = DType::GGML[i];
            i += 1;
        }
        all
    };

    /// The GGML types (those a GGUF file may hold): the first eight Tessera read, then the
    /// ones added with issue 18, in the order they were added.
    pub const GGML: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4K,
        DType::Q6K,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q5K,
        DType::Q3K,
        DType::Q2K,
        DType::IQ4NL,
        DType::IQ4XS,
    ];

    /// The CUDA kernel (`cuda/dequant_matmul.cu`) that multiplies rows of this type as they
    /// are stored, reading f32 activations; `None` for a type a cuda shard converts to bf16
    /// (or to f32 on its exact path) at upload. The one list of the types a GPU keeps
    /// quantized.
    pub const fn cuda_matvec(self) -> Option<&'static str> {
        match self {
            DType::Q8_0 => Some("matvec_q8_0"),
            DType::Q5_0 => Some("matvec_q5_0"),
            DType::Q4K => Some("matvec_q4_k"),
            DType::Q5K => Some("matvec_q5_k"),
            DType::Q6K => Some("matvec_q6_k"),
            DType::F8E4M3 => Some("matvec_f8_e4m3"),
            _ => None,
        }
    }

    /// Number of values in one block.
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::IQ4NL
            | DType::F8E4M3 => 32,
            DType::Q4K | DType::Q6K | DType::Q5K | DType::Q3K | DType::Q2K | DType::IQ4XS => 256,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4K => 144,
            DType::Q6K => 210,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q5K => 176,
            DType::Q3K => 110,
            DType::Q2K => 84,
            DType::IQ4NL => 18,
            DType::IQ4XS => 136,
            DType::F8E4M3 => 36,
        }
    }

    /// True for the block-quantized formats.
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of a row of `cols` values, or an error when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, KernelError> {
        if !cols.is_multiple_of(self.block_elems()) {
            return Err(KernelError::PartialBlock {
                dtype: self,
                cols,
                block_elems: self.block_elems(),
            });
        }
        Ok(cols / self.block_elems() * self.block_bytes())
    }

    /// The GGML type id used in GGUF files (`None`: not a GGML type).
    pub const fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q4K => 12,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q2K => 10,
            DType::Q3K => 11,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::IQ4NL => 20,
            DType::IQ4XS => 23,
            DType::BF16 => 30,
            DType::F8E4M3 => return None,
        })
    }

    /// The type with GGML id `id`, or `None` for a type Tessera does not support.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::GGML.into_iter().find(|d| d.ggml_id() == Some(id))
    }

    /// The name GGML and llama.cpp use (`Q4_K`, `BF16`, ...); safetensors' for FP8.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4K => "Q4_K",
            DType::Q6K => "Q6_K",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q5K => "Q5_K",
            DType::Q3K => "Q3_K",
            DType::Q2K => "Q2_K",
            DType::IQ4NL => "IQ4_NL",
            DType::IQ4XS => "IQ4_XS",
            DType::F8E4M3 => "F8_E4M3",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
