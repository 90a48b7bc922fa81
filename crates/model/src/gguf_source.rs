//! GGUF checkpoints as a [`TensorSource`]: tensors stay in the file's quantized types and
//! are borrowed from its memory map.

use std::path::Path;
use std::sync::Arc;

use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::weights::{Storage, TensorId, TensorSource, Weight};

/// The tensors of one GGUF file.
#[derive(Debug, Clone)]
pub struct GgufSource {
    file: Arc<GgufFile>,
}

/// One tensor's bytes, keeping the file (and its map) alive.
struct TensorBytes {
    file: Arc<GgufFile>,
    index: usize,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.file.tensor_data(&self.file.tensors()[self.index])
    }
}

impl GgufSource {
    pub fn new(file: Arc<GgufFile>) -> GgufSource {
        GgufSource { file }
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }
}

impl TensorSource for GgufSource {
    fn path(&self) -> &Path {
        self.file.path()
    }

    fn get(&self, id: TensorId) -> Result<Option<Weight>, ModelError> {
        let name = id.gguf_name();
        let Some(index) = self.file.tensors().iter().position(|t| t.name == name) else {
            return Ok(None);
        };
        let info = &self.file.tensors()[index];
        let len = info.n_bytes;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(TensorBytes {
            file: self.file.clone(),
            index,
        });
        let storage = Storage::new(owner, 0, len);
        Weight::new(
            self.path(),
            &name,
            info.dtype,
            info.rows(),
            info.cols(),
            storage,
        )
        .map(Some)
    }
}
