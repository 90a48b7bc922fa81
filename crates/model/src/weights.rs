//! Weight tensors and the files they come from.
//!
//! A [`Weight`] is a 2-D (or 1-D, as one row) tensor in its stored [`DType`], borrowing its
//! bytes from a shared memory map, so loading is lazy and a quantized model is never
//! expanded. [`TensorSource`] hides the file format: the model asks for a [`TensorId`]
//! and gets the tensor whatever the file calls it.

use std::path::Path;
use std::sync::Arc;

use tessera_kernels::DType;
use tessera_kernels::matmul::MatRef;

use crate::error::ModelError;

/// Bytes that live as long as any weight that points into them.
#[derive(Clone)]
pub struct Storage {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Storage {
    /// `owner[start..start + len]`; the caller has checked the range.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Storage {
        Storage { owner, start, len }
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
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

    /// Bytes of the stored tensor.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
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
    O(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
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
            TensorId::O(l) => layer(l, "self_attn.o_proj.weight"),
            TensorId::FfnNorm(l) => layer(l, "post_attention_layernorm.weight"),
            TensorId::Gate(l) => layer(l, "mlp.gate_proj.weight"),
            TensorId::Up(l) => layer(l, "mlp.up_proj.weight"),
            TensorId::Down(l) => layer(l, "mlp.down_proj.weight"),
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
            TensorId::O(l) => blk(l, "attn_output.weight"),
            TensorId::FfnNorm(l) => blk(l, "ffn_norm.weight"),
            TensorId::Gate(l) => blk(l, "ffn_gate.weight"),
            TensorId::Up(l) => blk(l, "ffn_up.weight"),
            TensorId::Down(l) => blk(l, "ffn_down.weight"),
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
