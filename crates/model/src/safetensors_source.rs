//! HuggingFace checkpoints: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`, memory-mapped.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use tessera_kernels::DType;
use tessera_kernels::mmap::{Mmap, map_file};

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
        let dtype = match entry.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::TensorType {
                    path: path.clone(),
                    tensor: name,
                    dtype: format!("{other:?}"),
                });
            }
        };
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
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = map.clone();
        let storage = Storage::new(owner, entry.start, entry.end - entry.start);
        Weight::new(path, &name, dtype, rows, cols, storage).map(Some)
    }
}
