//! Weight tensors and the files they come from.
//!
//! A [`Weight`] is a 2-D (or 1-D, as one row) tensor in its stored [`DType`], borrowing its
//! bytes from a shared memory map, so loading is lazy and a quantized model is never
//! expanded. [`TensorSource`] hides the file format: the model asks for a [`TensorId`]
//! and gets the tensor whatever the file calls it.
//!
//! Tensor parallelism cuts weights two ways: [`Weight::rows_slice`] (whole rows: a sub-range
//! of the same map, no copy; rows of a tensor converted at load, such as FP8 packed with its
//! scales, are copied out, so that a rank does not keep the whole tensor alive) and
//! [`Weight::cols_slice`] (a column range of every row: the per-row byte segments copied
//! into owned storage).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use tessera_kernels::matmul::MatRef;
use tessera_kernels::{DType, quant};

use crate::error::ModelError;

/// Bytes that live as long as any weight that points into them.
#[derive(Clone)]
pub struct Storage {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
    /// Bytes in memory of their own ([`Storage::from_vec`]), not a file's map.
    owned: bool,
}

impl Storage {
    /// `owner[start..start + len]`, a file's map; the caller has checked the range.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Storage {
        Storage {
            owner,
            start,
            len,
            owned: false,
        }
    }

    /// Bytes owned by this storage alone (a slice copied out of a map, or converted).
    pub fn from_vec(bytes: Vec<u8>) -> Storage {
        let len = bytes.len();
        Storage {
            owner: Arc::new(bytes),
            start: 0,
            len,
            owned: true,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `self[offset..offset + len]`; the caller has checked the range. A map's bytes are
    /// shared; a part of bytes in memory is copied, so that the rest can be freed.
    fn sub(&self, offset: usize, len: usize) -> Storage {
        if self.owned && len < self.len {
            return Storage::from_vec(self.bytes()[offset..offset + len].to_vec());
        }
        Storage {
            owner: Arc::clone(&self.owner),
            start: self.start + offset,
            len,
            owned: self.owned,
        }
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Storage({} bytes at {})", self.len, self.start)
    }
}

/// A tensor of `rows × cols` values of `dtype`, row-major (1-D tensors are one row).
#[derive(Clone, Debug)]
pub struct Weight {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
}

impl Weight {
    /// Checks that `storage` holds exactly `rows × cols` values of `dtype`.
    pub fn new(
        file: &Path,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
        storage: Storage,
    ) -> Result<Weight, ModelError> {
        let expected = dtype
            .row_bytes(cols)
            .ok()
            .and_then(|r| r.checked_mul(rows))
            .ok_or_else(|| ModelError::TensorShape {
                path: file.into(),
                tensor: name.into(),
                expected: vec![rows, cols],
                actual: vec![rows, cols],
            })?;
        if storage.len != expected {
            return Err(ModelError::Safetensors {
                path: file.into(),
                message: format!(
                    "tensor `{name}` holds {} bytes, but {rows}×{cols} {dtype} needs {expected}",
                    storage.len
                ),
            });
        }
        Ok(Weight {
            name: name.into(),
            dtype,
            rows,
            cols,
            storage,
        })
    }

    /// The tensor as a matrix for the kernels.
    pub fn mat(&self) -> MatRef<'_> {
        // Sizes were checked in `Weight::new`.
        MatRef::new(self.dtype, self.rows, self.cols, self.storage.bytes())
            .expect("weight size checked at construction")
    }

    /// All values as f32 (for small tensors: norms, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>, ModelError> {
        let mut out = vec![0.0; self.rows * self.cols];
        let m = self.mat();
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            m.dequantize_row(r, row)?;
        }
        Ok(out)
    }

    /// The same values held as `to` (F32, BF16 or F16): each row dequantized to f32, then
    /// rounded to nearest even for the 16-bit types.
    pub fn converted(&self, to: DType) -> Result<Weight, ModelError> {
        let encode: fn(f32, &mut Vec<u8>) = match to {
            DType::F32 => |v, out| out.extend_from_slice(&v.to_le_bytes()),
            DType::BF16 => |v, out| out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            DType::F16 => |v, out| out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            other => {
                return Err(ModelError::Plan {
                    message: format!(
                        "tensor `{}`: weights are not converted to {other}",
                        self.name
                    ),
                });
            }
        };
        let m = self.mat();
        let mut row = vec![0.0f32; self.cols];
        let mut out = Vec::with_capacity(to.row_bytes(self.cols)? * self.rows);
        for r in 0..self.rows {
            m.dequantize_row(r, &mut row)?;
            for &v in &row {
                encode(v, &mut out);
            }
        }
        Ok(Weight {
            name: self.name.clone(),
            dtype: to,
            rows: self.rows,
            cols: self.cols,
            storage: Storage::from_vec(out),
        })
    }

    /// Bytes of the stored tensor.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Bytes of the stored tensor, without touching them.
    pub fn storage_bytes(&self) -> usize {
        self.storage.len
    }

    /// Whether the bytes are a file's map (not memory of their own).
    pub fn is_mapped(&self) -> bool {
        !self.storage.owned
    }

    /// Rows `rows` as a tensor of their own, sharing this one's storage (rows are
    /// contiguous, so nothing is copied or read).
    pub fn rows_slice(&self, rows: Range<usize>) -> Result<Weight, ModelError> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(self.bad_slice("rows", &rows, self.rows));
        }
        let row_bytes = self.storage.len / self.rows.max(1);
        Ok(Weight {
            name: self.name.clone(),
            dtype: self.dtype,
            rows: rows.len(),
            cols: self.cols,
            storage: self
                .storage
                .sub(rows.start * row_bytes, rows.len() * row_bytes),
        })
    }

    /// True when columns `cols` start and end on block boundaries of the stored type, so
    /// that [`Weight::cols_slice`] keeps the type.
    pub fn cols_aligned(&self, cols: &Range<usize>) -> bool {
        let block = self.dtype.block_elems();
        cols.start.is_multiple_of(block) && cols.end.is_multiple_of(block)
    }

    /// Columns `cols` of every row, copied into owned storage: in the stored type when the
    /// range is block-aligned ([`Weight::cols_aligned`]), else dequantized to f32 (only the
    /// blocks the range touches are read).
    pub fn cols_slice(&self, cols: Range<usize>) -> Result<Weight, ModelError> {
        if cols.start > cols.end || cols.end > self.cols {
            return Err(self.bad_slice("columns", &cols, self.cols));
        }
        let m = self.mat();
        let (dtype, bytes) = if self.cols_aligned(&cols) {
            let block = self.dtype.block_elems();
            let (bb, start) = (self.dtype.block_bytes(), cols.start / block);
            let seg = (cols.end / block - start) * bb;
            let mut out = Vec::with_capacity(self.rows * seg);
            for r in 0..self.rows {
                out.extend_from_slice(&m.row(r)[start * bb..start * bb + seg]);
            }
            (self.dtype, out)
        } else {
            let block = self.dtype.block_elems();
            let (bb, first) = (self.dtype.block_bytes(), cols.start / block);
            let blocks = cols.end.div_ceil(block) - first;
            let skip = cols.start - first * block;
            let mut values = vec![0.0f32; blocks * block];
            let mut out = Vec::with_capacity(self.rows * cols.len() * 4);
            for r in 0..self.rows {
                let src = &m.row(r)[first * bb..(first + blocks) * bb];
                quant::dequantize_row(self.dtype, src, &mut values)?;
                for v in &values[skip..skip + cols.len()] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            (DType::F32, out)
        };
        let storage = Storage::from_vec(bytes);
        Ok(Weight {
            name: self.name.clone(),
            dtype,
            rows: self.rows,
            cols: cols.len(),
            storage,
        })
    }

    fn bad_slice(&self, what: &str, range: &Range<usize>, len: usize) -> ModelError {
        ModelError::Plan {
            message: format!(
                "tensor `{}`: {what} {range:?} are outside its {len} {what}",
                self.name
            ),
        }
    }
}

/// The tensors of a Llama-family checkpoint, independent of file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorId {
    Embed,
    FinalNorm,
    LmHead,
    Rope,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    /// Qwen3's per-head RMSNorm weights of q and k (`head_dim` values each).
    QNorm(usize),
    KNorm(usize),
    O(usize),
    FfnNorm(usize),
    /// Gemma 2's norms: before the MLP (its `ffn_norm`), and after attention and the MLP.
    PreFfnNorm(usize),
    PostAttnNorm(usize),
    PostFfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// Phi-3's fused projections: q, k and v rows stacked; gate and up rows stacked.
    Qkv(usize),
    GateUp(usize),
}

impl TensorId {
    /// The name in a HuggingFace checkpoint.
    pub fn hf_name(self) -> String {
        let layer = |l: usize, rest: &str| format!("model.layers.{l}.{rest}");
        match self {
            TensorId::Embed => "model.embed_tokens.weight".into(),
            TensorId::FinalNorm => "model.norm.weight".into(),
            TensorId::LmHead => "lm_head.weight".into(),
            TensorId::Rope => "rope_freqs.weight".into(),
            TensorId::AttnNorm(l) => layer(l, "input_layernorm.weight"),
            TensorId::Q(l) => layer(l, "self_attn.q_proj.weight"),
            TensorId::K(l) => layer(l, "self_attn.k_proj.weight"),
            TensorId::V(l) => layer(l, "self_attn.v_proj.weight"),
            TensorId::QBias(l) => layer(l, "self_attn.q_proj.bias"),
            TensorId::KBias(l) => layer(l, "self_attn.k_proj.bias"),
            TensorId::VBias(l) => layer(l, "self_attn.v_proj.bias"),
            TensorId::QNorm(l) => layer(l, "self_attn.q_norm.weight"),
            TensorId::KNorm(l) => layer(l, "self_attn.k_norm.weight"),
            TensorId::O(l) => layer(l, "self_attn.o_proj.weight"),
            TensorId::FfnNorm(l) => layer(l, "post_attention_layernorm.weight"),
            TensorId::PreFfnNorm(l) => layer(l, "pre_feedforward_layernorm.weight"),
            TensorId::PostAttnNorm(l) => layer(l, "post_attention_layernorm.weight"),
            TensorId::PostFfnNorm(l) => layer(l, "post_feedforward_layernorm.weight"),
            TensorId::Gate(l) => layer(l, "mlp.gate_proj.weight"),
            TensorId::Up(l) => layer(l, "mlp.up_proj.weight"),
            TensorId::Down(l) => layer(l, "mlp.down_proj.weight"),
            TensorId::Qkv(l) => layer(l, "self_attn.qkv_proj.weight"),
            TensorId::GateUp(l) => layer(l, "mlp.gate_up_proj.weight"),
        }
    }

    /// The name in a GGUF file (llama.cpp's convention).
    pub fn gguf_name(self) -> String {
        let blk = |l: usize, rest: &str| format!("blk.{l}.{rest}");
        match self {
            TensorId::Embed => "token_embd.weight".into(),
            TensorId::FinalNorm => "output_norm.weight".into(),
            TensorId::LmHead => "output.weight".into(),
            TensorId::Rope => "rope_freqs.weight".into(),
            TensorId::AttnNorm(l) => blk(l, "attn_norm.weight"),
            TensorId::Q(l) => blk(l, "attn_q.weight"),
            TensorId::K(l) => blk(l, "attn_k.weight"),
            TensorId::V(l) => blk(l, "attn_v.weight"),
            TensorId::QBias(l) => blk(l, "attn_q.bias"),
            TensorId::KBias(l) => blk(l, "attn_k.bias"),
            TensorId::VBias(l) => blk(l, "attn_v.bias"),
            TensorId::QNorm(l) => blk(l, "attn_q_norm.weight"),
            TensorId::KNorm(l) => blk(l, "attn_k_norm.weight"),
            TensorId::O(l) => blk(l, "attn_output.weight"),
            TensorId::FfnNorm(l) | TensorId::PreFfnNorm(l) => blk(l, "ffn_norm.weight"),
            TensorId::PostAttnNorm(l) => blk(l, "post_attention_norm.weight"),
            TensorId::PostFfnNorm(l) => blk(l, "post_ffw_norm.weight"),
            TensorId::Gate(l) => blk(l, "ffn_gate.weight"),
            TensorId::Up(l) => blk(l, "ffn_up.weight"),
            TensorId::Down(l) => blk(l, "ffn_down.weight"),
            TensorId::Qkv(l) => blk(l, "attn_qkv.weight"),
            // llama.cpp's phi3 keeps gate|up under the up projection's name.
            TensorId::GateUp(l) => blk(l, "ffn_up.weight"),
        }
    }
}

/// A checkpoint's tensors, whatever the file format.
pub trait TensorSource: Send + Sync {
    /// The file or directory, for messages.
    fn path(&self) -> &Path;
    /// The tensor, or `None` when the checkpoint does not have it.
    fn get(&self, id: TensorId) -> Result<Option<Weight>, ModelError>;

    /// The tensor, or an error naming it when it is missing.
    fn require(&self, id: TensorId) -> Result<Weight, ModelError> {
        self.get(id)?.ok_or_else(|| ModelError::MissingTensor {
            path: self.path().into(),
            tensor: id.hf_name(),
        })
    }

    /// The tensor, checked to be `rows × cols`.
    fn require_shape(&self, id: TensorId, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        check_shape(self.path(), self.require(id)?, rows, cols)
    }
}

/// `w` if it is `rows × cols`, else an error naming the file, the tensor and both shapes.
pub fn check_shape(path: &Path, w: Weight, rows: usize, cols: usize) -> Result<Weight, ModelError> {
    if (w.rows, w.cols) != (rows, cols) {
        return Err(ModelError::TensorShape {
            path: path.into(),
            tensor: w.name,
            expected: vec![rows, cols],
            actual: vec![w.rows, w.cols],
        });
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use tessera_kernels::quant::quantize_row_q8_0;

    use super::*;

    fn values(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect()
    }

    fn f32_weight(rows: usize, cols: usize) -> Weight {
        let bytes: Vec<u8> = values(rows, cols)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let storage = Storage::from_vec(bytes);
        Weight::new(Path::new("t"), "w", DType::F32, rows, cols, storage).unwrap()
    }

    fn q8_weight(rows: usize, cols: usize) -> Weight {
        let x = values(rows, cols);
        let row_bytes = DType::Q8_0.row_bytes(cols).unwrap();
        let mut bytes = vec![0u8; rows * row_bytes];
        for (src, dst) in x.chunks(cols).zip(bytes.chunks_mut(row_bytes)) {
            quantize_row_q8_0(src, dst).unwrap();
        }
        let storage = Storage::from_vec(bytes);
        Weight::new(Path::new("t"), "w", DType::Q8_0, rows, cols, storage).unwrap()
    }

    /// `w`'s bytes behind a map-like owner, as a file's tensors are held.
    fn mapped(w: &Weight) -> Weight {
        let map: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(w.bytes().to_vec());
        Weight {
            storage: Storage::new(map, 0, w.storage_bytes()),
            ..w.clone()
        }
    }

    /// A rank's rows of a tensor in memory (FP8 packed at load, say) are copied out, so
    /// that the whole tensor is freed once loading drops it.
    #[test]
    fn rows_of_owned_bytes_are_copied_out() {
        let owned = q8_weight(4, 64);
        let part = owned.rows_slice(1..3).unwrap();
        assert!(!Arc::ptr_eq(&owned.storage.owner, &part.storage.owner));
        assert_eq!(part.bytes(), &owned.bytes()[68..3 * 68]);
        let whole = owned.rows_slice(0..4).unwrap();
        assert!(Arc::ptr_eq(&owned.storage.owner, &whole.storage.owner));
    }

    fn cut(all: &[f32], cols: usize, rows: Range<usize>, take: Range<usize>) -> Vec<f32> {
        all.chunks(cols)
            .skip(rows.start)
            .take(rows.len())
            .flat_map(|r| r[take.clone()].to_vec())
            .collect()
    }

    #[test]
    fn rows_slice_shares_the_storage() {
        let w = mapped(&q8_weight(6, 64));
        let all = w.to_f32().unwrap();
        let s = w.rows_slice(2..5).unwrap();
        assert_eq!((s.rows, s.cols, s.dtype), (3, 64, DType::Q8_0));
        assert_eq!(s.storage_bytes(), 3 * 2 * 34);
        // Same bytes, not a copy: the slice points into the parent's storage.
        assert_eq!(s.bytes().as_ptr(), w.mat().row(2).as_ptr());
        assert_eq!(s.to_f32().unwrap(), cut(&all, 64, 2..5, 0..64));
        assert!(w.rows_slice(5..7).is_err());
    }

    #[test]
    fn aligned_cols_slice_keeps_the_quantized_type() {
        let w = q8_weight(3, 96);
        let all = w.to_f32().unwrap();
        assert!(w.cols_aligned(&(32..64)));
        let s = w.cols_slice(32..64).unwrap();
        assert_eq!((s.rows, s.cols, s.dtype), (3, 32, DType::Q8_0));
        assert_eq!(s.storage_bytes(), 3 * 34);
        assert_eq!(s.to_f32().unwrap(), cut(&all, 96, 0..3, 32..64));
    }

    #[test]
    fn unaligned_cols_slice_is_dequantized_to_f32() {
        let w = q8_weight(3, 96);
        let all = w.to_f32().unwrap();
        let take = 16..48;
        assert!(!w.cols_aligned(&take));
        let s = w.cols_slice(take.clone()).unwrap();
        assert_eq!((s.rows, s.cols, s.dtype), (3, 32, DType::F32));
        assert_eq!(s.to_f32().unwrap(), cut(&all, 96, 0..3, take));
        assert!(w.cols_slice(90..97).is_err());
    }

    /// A `rows × cols` weight of `dtype` whose bytes are a fixed pseudo-random sequence,
    /// with the scales of every block set to small finite values (and no FP8 NaN code).
    fn scrambled_weight(dtype: DType, rows: usize, cols: usize) -> Weight {
        let n_bytes = rows * dtype.row_bytes(cols).unwrap();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut bytes: Vec<u8> = (0..n_bytes)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                (state >> 56) as u8
            })
            .collect();
        for (b, block) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
            for (k, &at) in quant::f16_scale_offsets(dtype).iter().enumerate() {
                let v = 0.01 * (1 + (b + k) % 7) as f32;
                block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
            if dtype == DType::F8E4M3 {
                quant::fp8::make_finite(block, 0.01 * (1 + b % 7) as f32);
            }
        }
        Weight::new(
            Path::new("t"),
            "w",
            dtype,
            rows,
            cols,
            Storage::from_vec(bytes),
        )
        .unwrap()
    }

    #[test]
    fn cols_slices_of_every_block_type_follow_its_block_size() {
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let block = dtype.block_elems();
            let cols = 4 * block;
            let w = scrambled_weight(dtype, 3, cols);
            let all = w.to_f32().unwrap();
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            // Two ranks: each half is whole blocks and keeps the stored type.
            for take in [0..2 * block, 2 * block..cols] {
                assert!(w.cols_aligned(&take), "{dtype} {take:?}");
                let s = w.cols_slice(take.clone()).unwrap();
                assert_eq!((s.rows, s.cols, s.dtype), (3, 2 * block, dtype));
                assert_eq!(s.storage_bytes(), 3 * 2 * dtype.block_bytes(), "{dtype}");
                let want = cut(&all, cols, 0..3, take);
                assert_eq!(bits(s.to_f32().unwrap()), bits(want), "{dtype}");
            }
            // Three ranks: the middle third starts and ends inside blocks, so it is f32.
            let take = cols / 3..2 * cols / 3;
            assert!(!w.cols_aligned(&take), "{dtype} {take:?}");
            let s = w.cols_slice(take.clone()).unwrap();
            assert_eq!((s.cols, s.dtype), (take.len(), DType::F32), "{dtype}");
            let want = cut(&all, cols, 0..3, take);
            assert_eq!(bits(s.to_f32().unwrap()), bits(want), "{dtype}");
        }
    }

    #[test]
    fn float_cols_slice_copies_exact_values() {
        let w = f32_weight(4, 10);
        let s = w.cols_slice(3..7).unwrap();
        assert_eq!(s.dtype, DType::F32);
        assert_eq!(s.to_f32().unwrap(), cut(&values(4, 10), 10, 0..4, 3..7));
    }
}
