//! A small GGUF writer for the malformed-file tests: builds files byte by byte, so a test can
//! put any value in any field. Shared by `gguf_malformed.rs` (header and metadata) and
//! `gguf_malformed_tensors.rs` (tensor directory and data).

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::path::PathBuf;

use tessera_kernels::DType;
use tessera_model::gguf::{GgufError, GgufFile};

// GGUF value type ids.
pub const T_U8: u32 = 0;
pub const T_U32: u32 = 4;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;

/// Little-endian encoding helpers.
pub fn le32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

pub fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

pub fn gstr(s: &str) -> Vec<u8> {
    [le64(s.len() as u64), s.as_bytes().to_vec()].concat()
}

pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub n_bytes: usize,
    /// Relative data offset; `None` places it after the previous tensor, aligned.
    pub offset: Option<u64>,
}

/// A GGUF file under construction.
pub struct Gguf {
    pub version: u32,
    /// Encoded metadata entries (key, type, value).
    pub kvs: Vec<Vec<u8>>,
    pub tensors: Vec<TensorSpec>,
    pub alignment: u64,
}

impl Gguf {
    pub fn new() -> Gguf {
        Gguf {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    /// A metadata entry with an already encoded value.
    pub fn kv(mut self, key: &str, type_id: u32, value: Vec<u8>) -> Gguf {
        self.kvs.push([gstr(key), le32(type_id), value].concat());
        self
    }

    pub fn kv_u32(self, key: &str, v: u32) -> Gguf {
        self.kv(key, T_U32, le32(v))
    }

    pub fn kv_str(self, key: &str, s: &str) -> Gguf {
        self.kv(key, T_STRING, gstr(s))
    }

    pub fn kv_strs(self, key: &str, items: &[&str]) -> Gguf {
        let mut value = [le32(T_STRING), le64(items.len() as u64)].concat();
        for s in items {
            value.extend(gstr(s));
        }
        self.kv(key, T_ARRAY, value)
    }

    pub fn alignment(mut self, alignment: u32) -> Gguf {
        self.alignment = u64::from(alignment);
        self.kv_u32("general.alignment", alignment)
    }

    pub fn tensor(self, name: &str, dims: &[u64], dtype: DType) -> Gguf {
        let rows: u64 = dims[1..].iter().product();
        let n_bytes = dtype.row_bytes(dims[0] as usize).unwrap() * rows as usize;
        self.raw_tensor(
            name,
            dims,
            dtype.ggml_id().expect("a GGML type"),
            n_bytes,
            None,
        )
    }

    pub fn raw_tensor(
        mut self,
        name: &str,
        dims: &[u64],
        type_id: u32,
        n_bytes: usize,
        offset: Option<u64>,
    ) -> Gguf {
        self.tensors.push(TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            n_bytes,
            offset,
        });
        self
    }

    pub fn bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.next_multiple_of(self.alignment as usize);
        let mut out = b"GGUF".to_vec();
        out.extend(le32(self.version));
        out.extend(le64(self.tensors.len() as u64));
        out.extend(le64(self.kvs.len() as u64));
        for kv in &self.kvs {
            out.extend(kv);
        }
        let mut next = 0usize;
        let mut data = Vec::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let offset = t.offset.unwrap_or(next as u64);
            out.extend(gstr(&t.name));
            out.extend(le32(t.dims.len() as u32));
            for d in &t.dims {
                out.extend(le64(*d));
            }
            out.extend(le32(t.type_id));
            out.extend(le64(offset));
            // Data: a pattern that differs per tensor, then padding.
            data.resize(align(data.len()), 0);
            data.extend((0..t.n_bytes).map(|j| (i * 31 + j) as u8));
            next = align(data.len());
        }
        out.resize(align(out.len()), 0);
        data.resize(align(data.len()), 0);
        out.extend(data);
        out
    }
}

/// A small valid file: metadata of several types and three tensors, one of them 3-D.
pub fn valid() -> Gguf {
    Gguf::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_strs("tokenizer.ggml.tokens", &["<s>", "a", "b"])
        .kv("flag", T_BOOL, vec![1])
        .tensor("token_embd.weight", &[64, 3], DType::Q8_0)
        .tensor("blk.0.ffn_up.weight", &[256, 2, 3], DType::Q4K)
        .tensor("output_norm.weight", &[64], DType::F32)
}

pub struct Scratch {
    pub _dir: tempfile::TempDir,
    pub path: PathBuf,
}

pub fn scratch() -> Scratch {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    Scratch { _dir: dir, path }
}

pub fn open_bytes(s: &Scratch, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    std::fs::write(&s.path, bytes).unwrap();
    GgufFile::open(&s.path)
}

/// Opens `bytes`, expects an error, checks it names the file and each of `names`.
pub fn open_err(bytes: &[u8], names: &[&str]) -> GgufError {
    let s = scratch();
    let err = open_bytes(&s, bytes).expect_err("malformed file opened");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&s.path.display().to_string()),
        "no path in: {msg}"
    );
    for name in names {
        assert!(msg.contains(name), "{name:?} missing from: {msg}");
    }
    err
}
