//! The GGUF container (versions 3 and 2): metadata and tensor directory, read from a
//! read-only memory map with every length and offset checked, so that no input makes the
//! reader panic or allocate more than the file can justify.
//!
//! [`GgufFile::open`] maps the file, parses the header, the metadata ([`GgufValue`]s by key)
//! and the tensor directory ([`GgufTensorInfo`]), and checks that every tensor is of a type
//! Tessera supports, has whole blocks per row, is aligned, and lies inside the file. Tensor
//! bytes are then borrowed from the map without copying ([`GgufFile::tensor_data`],
//! [`GgufFile::tensor_rows`]); the block formats themselves belong to
//! `tessera_kernels::quant`.
//!
//! Size limits (constants in [`parse`]) bound every allocation driven by a count in the file.
//! Format reference: the GGUF specification in the ggml repository (`docs/gguf.md`).

mod error;
pub mod parse;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tessera_kernels::DType;
use tessera_kernels::mmap::{Mmap, map_file};

pub use error::{GgufError, SUPPORTED_TYPES, ggml_type_name};

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The GGUF name of this value's type (`u32`, `string`, `array`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F32(_) => "f32",
            GgufValue::F64(_) => "f64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }

    /// The value of any integer type, widened.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The type for error messages: `a u32`, `an array of string`, `an empty array`.
    fn describe(&self) -> String {
        match self {
            GgufValue::Array(items) => match items.first() {
                Some(first) => format!("an array of {}", first.type_name()),
                None => "an empty array".into(),
            },
            GgufValue::I8(_)
            | GgufValue::I16(_)
            | GgufValue::I32(_)
            | GgufValue::I64(_)
            | GgufValue::F32(_)
            | GgufValue::F64(_) => format!("an {}", self.type_name()),
            other => format!("a {}", other.type_name()),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the row length (the fastest-varying index).
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    /// Bytes of the whole tensor.
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    /// Values per row (`dims[0]`).
    pub fn cols(&self) -> usize {
        let cols = self.dims.first().copied().unwrap_or(1);
        usize::try_from(cols).unwrap_or(usize::MAX)
    }

    /// Number of rows: the product of `dims[1..]` (1 for a vector).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).fold(1usize, |n, &d| {
            n.saturating_mul(usize::try_from(d).unwrap_or(usize::MAX))
        })
    }
}

/// An open GGUF file: its memory map, metadata and tensor directory.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The metadata holds whole vocabularies: show sizes, not contents.
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("file_bytes", &self.map.len())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Maps and parses the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.into(),
            source,
        };
        if std::fs::metadata(path).map_err(io)?.is_dir() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "is a directory, not a GGUF file",
            )));
        }
        let map = map_file(path).map_err(io)?;
        let parsed = parse::parse(path, &map)?;
        Ok(GgufFile {
            path: path.into(),
            map,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name: parsed.by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version: 3, or 2 for older files.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section; tensor offsets are at or past it.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// An integer of any type that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get(key)
            .map(|v| {
                let n = v
                    .as_integer()
                    .ok_or_else(|| wrong_type(&self.path, key, "an integer", v))?;
                u32::try_from(n).map_err(|_| out_of_range(&self.path, key, n, "u32"))
            })
            .transpose()
    }

    /// An integer of any type that fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key)
            .map(|v| value_as_u64(&self.path, key, v))
            .transpose()
    }

    /// An f32, or an f64 rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.get(key)
            .map(|v| value_as_f32(&self.path, key, v))
            .transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key)
            .map(|v| match v {
                GgufValue::Bool(b) => Ok(*b),
                other => Err(wrong_type(&self.path, key, "a bool", other)),
            })
            .transpose()
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key)
            .map(|v| match v {
                GgufValue::String(s) => Ok(s.as_str()),
                other => Err(wrong_type(&self.path, key, "a string", other)),
            })
            .transpose()
    }

    /// An array of strings (possibly empty).
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.array(key, "an array of string", |_, v| match v {
            GgufValue::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// An array of f32 (f64 elements are rounded to f32).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.array(key, "an array of f32", |_, v| match v {
            GgufValue::F32(x) => Some(Ok(*x)),
            GgufValue::F64(_) => Some(value_as_f32(&self.path, key, v)),
            _ => None,
        })?
        .map(|items| items.into_iter().collect())
        .transpose()
    }

    /// An array of integers of any type whose values fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.array(key, "an array of integers", |i, v| {
            v.as_integer().map(|n| {
                i32::try_from(n)
                    .map_err(|_| out_of_range(&self.path, &format!("{key}[{i}]"), n, "i32"))
            })
        })?
        .map(|items| items.into_iter().collect())
        .transpose()
    }

    /// Converts each element of the array at `key` with `f`; an element `f` refuses (returns
    /// `None` for) makes the whole key a `WrongType` error.
    fn array<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        f: impl Fn(usize, &'s GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>, GgufError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let GgufValue::Array(items) = value else {
            return Err(wrong_type(&self.path, key, expected, value));
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match f(i, item) {
                Some(x) => out.push(x),
                None => {
                    return Err(GgufError::WrongType {
                        path: self.path.clone(),
                        key: key.into(),
                        expected,
                        found: format!("an array whose element {i} is {}", item.describe()),
                    });
                }
            }
        }
        Ok(Some(out))
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The bytes of a tensor of this file, borrowed from the map. An `info` that does not lie
    /// inside this file (one from another file) gives an empty slice.
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        self.slice(info.offset, info.n_bytes).unwrap_or(&[])
    }

    /// The bytes of whole rows `rows` of a tensor (a row is `info.cols()` values), for loading
    /// one rank's slice of a matrix.
    pub fn tensor_rows(
        &self,
        info: &GgufTensorInfo,
        rows: Range<usize>,
    ) -> Result<&[u8], GgufError> {
        let n_rows = info.rows();
        let range_error = || GgufError::RowRange {
            path: self.path.clone(),
            tensor: info.name.clone(),
            start: rows.start,
            end: rows.end,
            rows: n_rows,
        };
        if rows.start > rows.end || rows.end > n_rows {
            return Err(range_error());
        }
        if rows.is_empty() {
            return Ok(&[]);
        }
        let row_bytes = info.n_bytes / n_rows;
        let start = rows.start.checked_mul(row_bytes);
        let len = rows.len().checked_mul(row_bytes);
        let offset = start.and_then(|s| info.offset.checked_add(s as u64));
        match (offset, len) {
            (Some(offset), Some(len)) => self.slice(offset, len).ok_or_else(range_error),
            _ => Err(range_error()),
        }
    }

    /// `len` bytes of the map at `offset`, if they lie inside it.
    fn slice(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        self.map.get(start..start.checked_add(len)?)
    }
}

/// An integer value as u64, for `key` of the file at `path`.
pub(crate) fn value_as_u64(path: &Path, key: &str, value: &GgufValue) -> Result<u64, GgufError> {
    let n = value
        .as_integer()
        .ok_or_else(|| wrong_type(path, key, "an integer", value))?;
    u64::try_from(n).map_err(|_| out_of_range(path, key, n, "u64"))
}

/// An f32 or f64 value as f32; an f64 too large for f32 is out of range.
fn value_as_f32(path: &Path, key: &str, value: &GgufValue) -> Result<f32, GgufError> {
    match *value {
        GgufValue::F32(x) => Ok(x),
        GgufValue::F64(x) => {
            let y = x as f32;
            if y.is_infinite() && x.is_finite() {
                return Err(out_of_range(path, key, x, "f32"));
            }
            Ok(y)
        }
        _ => Err(wrong_type(path, key, "a float", value)),
    }
}

fn wrong_type(path: &Path, key: &str, expected: &'static str, found: &GgufValue) -> GgufError {
    GgufError::WrongType {
        path: path.into(),
        key: key.into(),
        expected,
        found: found.describe(),
    }
}

fn out_of_range(
    path: &Path,
    key: &str,
    value: impl fmt::Display,
    target: &'static str,
) -> GgufError {
    GgufError::OutOfRange {
        path: path.into(),
        key: key.into(),
        value: value.to_string(),
        target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dims: &[u64]) -> GgufTensorInfo {
        GgufTensorInfo {
            name: "t".into(),
            dims: dims.to_vec(),
            dtype: DType::F32,
            offset: 0,
            n_bytes: 0,
        }
    }

    #[test]
    fn rows_are_the_product_of_the_outer_dims() {
        assert_eq!((info(&[512]).cols(), info(&[512]).rows()), (512, 1));
        assert_eq!(
            (info(&[64, 3, 2]).cols(), info(&[64, 3, 2]).rows()),
            (64, 6)
        );
        assert_eq!(info(&[8, u64::MAX, 2]).rows(), usize::MAX);
    }

    #[test]
    fn values_describe_their_type() {
        assert_eq!(GgufValue::U32(1).describe(), "a u32");
        assert_eq!(GgufValue::I8(1).describe(), "an i8");
        assert_eq!(GgufValue::Array(vec![]).describe(), "an empty array");
        let strings = GgufValue::Array(vec![GgufValue::String("a".into())]);
        assert_eq!(strings.describe(), "an array of string");
    }

    #[test]
    fn integers_widen_and_convert_with_range_checks() {
        let path = Path::new("x.gguf");
        assert_eq!(value_as_u64(path, "k", &GgufValue::I16(7)).unwrap(), 7);
        let err = value_as_u64(path, "k", &GgufValue::I64(-1)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "x.gguf: metadata key k = -1 does not fit in u64"
        );
        let err = value_as_u64(path, "k", &GgufValue::F32(1.0)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "x.gguf: metadata key k is an f32, expected an integer"
        );
        assert_eq!(value_as_f32(path, "k", &GgufValue::F64(0.5)).unwrap(), 0.5);
        assert!(value_as_f32(path, "k", &GgufValue::F64(1e300)).is_err());
        assert!(
            value_as_f32(path, "k", &GgufValue::F64(f64::INFINITY))
                .unwrap()
                .is_infinite()
        );
    }
}
