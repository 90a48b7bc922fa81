//! HuggingFace checkpoints: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`, memory-mapped.
//!
//! Float tensors are served from the mapping as stored. An FP8 (`F8_E4M3`) weight, as
//! compressed-tensors checkpoints hold their projections, is read with its `weight_scale`
//! (one per tensor, or one per output row) into [`DType::F8E4M3`] blocks, each carrying its
//! row's scale (`config/quant.rs` checks the config that declares them).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use tessera_kernels::DType;
use tessera_kernels::mmap::{Mmap, map_file};
use tessera_kernels::quant::{dequantize_row, fp8};

use crate::config::read_json;
use crate::error::ModelError;
use crate::weights::{Storage, TensorId, TensorSource, Weight};

/// One tensor's place: which file, dtype, shape, absolute byte range.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The tensors of a HuggingFace model directory.
pub struct SafetensorsSource {
    dir: PathBuf,
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for SafetensorsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsSource")
            .field("dir", &self.dir)
            .field("files", &self.files.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

#[derive(Deserialize)]
struct IndexSpec {
    weight_map: BTreeMap<String, String>,
}

impl SafetensorsSource {
    /// Opens the checkpoint files of `dir` and reads their headers (no tensor data yet).
    pub fn open(dir: &Path) -> Result<SafetensorsSource, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index.exists() {
            let spec: IndexSpec = read_json(&index)?;
            let mut files: Vec<String> = spec.weight_map.into_values().collect();
            files.sort();
            files.dedup();
            files
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".into()]
        } else {
            return Err(ModelError::io(
                dir.join("model.safetensors"),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in the directory",
                ),
            ));
        };
        let mut source = SafetensorsSource {
            dir: dir.into(),
            files: Vec::new(),
            entries: HashMap::new(),
        };
        for name in names {
            source.add_file(&dir.join(name))?;
        }
        Ok(source)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), ModelError> {
        if path
            .file_name()
            .is_none_or(|n| n.to_string_lossy().contains(['/', '\\']))
        {
            return Err(ModelError::Safetensors {
                path: path.into(),
                message: "shard names in the index must be plain file names".into(),
            });
        }
        let map = map_file(path).map_err(|e| ModelError::io(path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| ModelError::Safetensors {
                path: path.into(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
        let data_start = 8 + header_len;
        let file = self.files.len();
        for (name, info) in metadata.tensors() {
            let (s, e) = info.data_offsets;
            let entry = Entry {
                file,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + s,
                end: data_start + e,
            };
            if self.entries.insert(name.clone(), entry).is_some() {
                return Err(ModelError::Safetensors {
                    path: path.into(),
                    message: format!("tensor `{name}` appears in more than one file"),
                });
            }
        }
        self.files.push((path.into(), Arc::new(map)));
        Ok(())
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

impl TensorSource for SafetensorsSource {
    fn path(&self) -> &Path {
        &self.dir
    }

    fn get(&self, id: TensorId) -> Result<Option<Weight>, ModelError> {
        let name = id.hf_name();
        let Some(entry) = self.entries.get(&name) else {
            return Ok(None);
        };
        let (path, map) = &self.files[entry.file];
        let (rows, cols) = match entry.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            other => {
                return Err(ModelError::TensorShape {
                    path: path.clone(),
                    tensor: name,
                    expected: vec![],
                    actual: other.to_vec(),
                });
            }
        };
        if entry.dtype == Dtype::F8_E4M3 {
            return self.fp8_weight(&name, entry, rows, cols).map(Some);
        }
        let dtype = float_type(path, &name, entry.dtype)?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = map.clone();
        let storage = Storage::new(owner, entry.start, entry.end - entry.start);
        Weight::new(path, &name, dtype, rows, cols, storage).map(Some)
    }
}

impl SafetensorsSource {
    /// The FP8 weight `name` (`rows × cols`) with its scales from `<name>_scale`, packed
    /// into [`DType::F8E4M3`] blocks.
    fn fp8_weight(
        &self,
        name: &str,
        entry: &Entry,
        rows: usize,
        cols: usize,
    ) -> Result<Weight, ModelError> {
        let path = &self.files[entry.file].0;
        let bad = |message: String| ModelError::Safetensors {
            path: path.clone(),
            message,
        };
        let scale_name = format!("{name}_scale");
        let scales = self.scales(&scale_name, rows, (name, path))?;
        if !cols.is_multiple_of(fp8::F8_E4M3_BLOCK_VALUES) {
            return Err(bad(format!(
                "FP8 tensor `{name}` has rows of {cols} values; Tessera needs a multiple of \
                 {} (every published FP8 model's are)",
                fp8::F8_E4M3_BLOCK_VALUES
            )));
        }
        let codes = self.bytes(entry);
        if codes.len() != rows * cols {
            return Err(bad(format!(
                "FP8 tensor `{name}` holds {} bytes, not {rows} × {cols}",
                codes.len()
            )));
        }
        let row_bytes = DType::F8E4M3.row_bytes(cols)?;
        let mut packed = vec![0u8; rows * row_bytes];
        let rows_out = packed.chunks_exact_mut(row_bytes.max(1));
        for (r, (out, row)) in rows_out.zip(codes.chunks_exact(cols.max(1))).enumerate() {
            let scale = if scales.len() == 1 {
                scales[0]
            } else {
                scales[r]
            };
            fp8::pack_row(row, scale, out)?;
        }
        let storage = Storage::from_vec(packed);
        Weight::new(path, name, DType::F8E4M3, rows, cols, storage)
    }

    /// The scales `scale_name` of FP8 tensor `of` (`rows` rows, in file `of_path`): one for
    /// the tensor (shape `[]` or `[1]`) or one per row (`[rows]` or `[rows, 1]`), each
    /// finite.
    fn scales(
        &self,
        scale_name: &str,
        rows: usize,
        (of, of_path): (&str, &Path),
    ) -> Result<Vec<f32>, ModelError> {
        let Some(entry) = self.entries.get(scale_name) else {
            return Err(ModelError::Safetensors {
                path: of_path.into(),
                message: format!("FP8 tensor `{of}` has no scale tensor `{scale_name}`"),
            });
        };
        let path = &self.files[entry.file].0;
        let count = match entry.shape.as_slice() {
            [] | [1] => 1,
            [r] | [r, 1] if *r == rows => rows,
            other => {
                return Err(ModelError::TensorShape {
                    path: path.clone(),
                    tensor: scale_name.into(),
                    expected: vec![rows, 1],
                    actual: other.to_vec(),
                });
            }
        };
        let dtype = float_type(path, scale_name, entry.dtype)?;
        let mut scales = vec![0.0f32; count];
        dequantize_row(dtype, self.bytes(entry), &mut scales)?;
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            return Err(ModelError::Safetensors {
                path: path.clone(),
                message: format!("scale tensor `{scale_name}` holds {bad}, not a finite scale"),
            });
        }
        Ok(scales)
    }

    /// The stored bytes of `entry`.
    fn bytes(&self, entry: &Entry) -> &[u8] {
        let map: &[u8] = self.files[entry.file].1.as_ref().as_ref();
        &map[entry.start..entry.end]
    }
}

/// The [`DType`] of a float tensor `name` stored as `dtype`.
fn float_type(path: &Path, name: &str, dtype: Dtype) -> Result<DType, ModelError> {
    match dtype {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F16 => Ok(DType::F16),
        Dtype::BF16 => Ok(DType::BF16),
        other => Err(ModelError::TensorType {
            path: path.into(),
            tensor: name.into(),
            dtype: format!("{other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use safetensors::tensor::{TensorView, serialize};

    use super::*;

    /// A tensor to write: name, dtype, shape, bytes.
    type Stored<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

    /// A directory whose `model.safetensors` holds `tensors`.
    fn checkpoint(tensors: &[Stored<'_>]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                (
                    *name,
                    TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect::<Vec<_>>();
        let bytes = serialize(views, None).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        dir
    }

    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    const SCALE: &str = "model.layers.0.self_attn.q_proj.weight_scale";

    fn q_proj(tensors: &[Stored<'_>]) -> Result<Weight, ModelError> {
        let dir = checkpoint(tensors);
        let source = SafetensorsSource::open(dir.path()).unwrap();
        source
            .get(TensorId::Q(0))
            .map(|w| w.expect("q_proj is there"))
    }

    /// Codes 0x38 (1.0) and 0x40 (2.0), alternating, `rows × cols`.
    fn codes(rows: usize, cols: usize) -> Vec<u8> {
        (0..rows * cols)
            .map(|i| if i % 2 == 0 { 0x38 } else { 0x40 })
            .collect()
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn fp8_weights_take_their_tensor_or_row_scales() {
        let per_tensor = q_proj(&[
            (Q, Dtype::F8_E4M3, vec![2, 32], codes(2, 32)),
            (SCALE, Dtype::F32, vec![1], f32_bytes(&[0.5])),
        ])
        .unwrap();
        assert_eq!(per_tensor.dtype, DType::F8E4M3);
        let values = per_tensor.to_f32().unwrap();
        assert_eq!(&values[..4], &[0.5, 1.0, 0.5, 1.0]);
        assert_eq!(&values[32..36], &[0.5, 1.0, 0.5, 1.0]);
        let bf16 = |v: f32| half::bf16::from_f32(v).to_le_bytes();
        let per_row = q_proj(&[
            (Q, Dtype::F8_E4M3, vec![2, 32], codes(2, 32)),
            (
                SCALE,
                Dtype::BF16,
                vec![2, 1],
                [bf16(0.25), bf16(3.0)].concat(),
            ),
        ])
        .unwrap();
        let values = per_row.to_f32().unwrap();
        assert_eq!(&values[..2], &[0.25, 0.5]);
        assert_eq!(&values[32..34], &[3.0, 6.0]);
    }

    /// Each broken FP8 tensor is one error naming the tensor at fault.
    #[test]
    fn broken_fp8_tensors_are_clear_errors() {
        let weight = (Q, Dtype::F8_E4M3, vec![2, 32], codes(2, 32));
        let cases: [(Vec<Stored<'_>>, &str); 5] = [
            (
                vec![weight.clone()],
                "has no scale tensor `model.layers.0.self_attn.q_proj.weight_scale`",
            ),
            (
                vec![
                    weight.clone(),
                    (SCALE, Dtype::F32, vec![3], f32_bytes(&[1.0; 3])),
                ],
                "has shape [3]",
            ),
            (
                vec![
                    weight.clone(),
                    (SCALE, Dtype::F32, vec![1], f32_bytes(&[f32::NAN])),
                ],
                "holds NaN, not a finite scale",
            ),
            (
                vec![weight.clone(), (SCALE, Dtype::I32, vec![1], vec![0; 4])],
                "has type I32",
            ),
            (
                vec![
                    (Q, Dtype::F8_E4M3, vec![2, 40], codes(2, 40)),
                    (SCALE, Dtype::F32, vec![1], f32_bytes(&[1.0])),
                ],
                "has rows of 40 values; Tessera needs a multiple of 32",
            ),
        ];
        for (tensors, wanted) in cases {
            let message = q_proj(&tensors).unwrap_err().to_string();
            assert!(message.contains(wanted), "{wanted:?} not in: {message}");
            assert!(message.contains("q_proj.weight"), "{message}");
        }
    }
}
