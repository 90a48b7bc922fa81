//! Parsing of the GGUF header, metadata and tensor directory from the bytes of a file, with
//! every length checked against the bytes that remain before anything is allocated.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor count u64, metadata count
//! u64; then each metadata entry (key string, value type u32, value); then each tensor's
//! info (name string, n_dims u32, n_dims × u64 dims, GGML type u32, data offset u64 relative
//! to the data section); then padding to `general.alignment`; then the data section. A string
//! is a u64 byte length and UTF-8 bytes; an array is an element type u32, a u64 count and the
//! elements.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use tessera_kernels::DType;

use super::error::{GgufError, ggml_type_name};
use super::{GgufTensorInfo, GgufValue};

/// Longest metadata string value. The longest real values are chat templates (tens of KiB);
/// 16 MiB leaves two orders of magnitude of room while bounding a single allocation.
pub const MAX_STRING_BYTES: u64 = 16 << 20;
/// Longest metadata key or tensor name: the GGUF specification caps keys at 65535 bytes (GGML
/// itself caps tensor names at 63), so nothing valid is longer.
pub const MAX_NAME_BYTES: u64 = 65_535;
/// Most elements in one metadata array. The largest real arrays are vocabularies and merge
/// lists (256 Ki tokens for the largest vocabularies); 16 Mi is 64 times that.
pub const MAX_ARRAY_ELEMS: u64 = 16 << 20;
/// Most metadata values (array elements included) in one file: twice one maximal array. A
/// value takes 32 bytes in memory, so this bounds the metadata to about 1 GiB even for a file
/// crafted to amplify (one-byte values), while real files hold about 1 Mi values.
pub const MAX_METADATA_VALUES: u64 = 32 << 20;
/// Deepest nesting of arrays. GGUF allows arrays of arrays but no known key uses them; the
/// bound keeps the recursive reader's stack depth fixed.
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Most metadata entries. Real files hold tens; 1 Mi bounds the key map.
pub const MAX_KV_COUNT: u64 = 1 << 20;
/// Most tensors in one file. The largest checkpoints hold a few thousand per file; 1 Mi is
/// far above that and bounds the directory's allocation.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most dimensions of a tensor: `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Data alignment when `general.alignment` is absent, as the specification says.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Smallest encoding of a metadata entry: empty key (8), value type (4), one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of a tensor info: empty name (8), n_dims (4), one dim (8), type (4),
/// offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// Everything read from the file before its data section.
#[derive(Debug)]
pub(super) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub by_name: HashMap<String, usize>,
}

/// What is being read, for error messages; formatting happens only when an error is built.
#[derive(Clone, Copy, Debug)]
enum Site<'a> {
    Header(&'static str),
    KeyName(u64),
    Value(&'a str),
    TensorName(u64),
    Tensor(&'a str, &'static str),
}

impl fmt::Display for Site<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Site::Header(field) => write!(f, "the header ({field})"),
            Site::KeyName(i) => write!(f, "the name of metadata entry #{i}"),
            Site::Value(key) => write!(f, "the value of metadata key {key}"),
            Site::TensorName(i) => write!(f, "the name of tensor #{i}"),
            Site::Tensor(name, field) => write!(f, "the {field} of tensor {name}"),
        }
    }
}

/// A read position in the file's bytes.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
    /// Metadata values read so far, against [`MAX_METADATA_VALUES`].
    values: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos.min(self.bytes.len())) as u64
    }

    fn take(&mut self, n: u64, site: Site<'_>) -> Result<&'a [u8], GgufError> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n))
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(GgufError::Truncated {
                path: self.path.into(),
                what: site.to_string(),
                offset: self.pos as u64,
                needed: n,
                file_bytes: self.bytes.len() as u64,
            });
        };
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, site: Site<'_>) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, site)?);
        Ok(out)
    }

    fn u32(&mut self, site: Site<'_>) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(site)?))
    }

    fn u64(&mut self, site: Site<'_>) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(site)?))
    }

    /// A length-prefixed UTF-8 string of at most `limit` bytes.
    fn string(&mut self, limit: u64, site: Site<'_>) -> Result<&'a str, GgufError> {
        let len = self.u64(site)?;
        if len > limit {
            return Err(self.limit(format!("the length of {site}"), len, limit));
        }
        let bytes = self.take(len, site)?;
        std::str::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path.into(),
            what: site.to_string(),
        })
    }

    /// Checks a count read from the file against its limit and against how many items of at
    /// least `min_bytes` each the rest of the file can hold, before anything is allocated.
    fn check_count(
        &self,
        count: u64,
        limit: u64,
        min_bytes: u64,
        what: impl Fn() -> String,
    ) -> Result<(), GgufError> {
        if count > limit {
            return Err(self.limit(what(), count, limit));
        }
        let fits = self.remaining() / min_bytes.max(1);
        if count > fits {
            return Err(GgufError::CountTooLarge {
                path: self.path.into(),
                what: what(),
                count,
                remaining_bytes: self.remaining(),
                fits,
            });
        }
        Ok(())
    }

    fn limit(&self, what: String, value: u64, limit: u64) -> GgufError {
        GgufError::LimitExceeded {
            path: self.path.into(),
            what,
            value,
            limit,
        }
    }
}

/// Parses everything before the data section of the GGUF file `bytes` (read from `path`).
pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor {
        path,
        bytes,
        pos: 0,
        values: 0,
    };
    let version = read_version(&mut c)?;
    let n_tensors = c.u64(Site::Header("tensor count"))?;
    let n_kv = c.u64(Site::Header("metadata count"))?;
    c.check_count(n_kv, MAX_KV_COUNT, MIN_KV_BYTES, || {
        "the metadata count".into()
    })?;
    let metadata = read_metadata(&mut c, n_kv)?;
    let alignment = alignment(path, &metadata)?;
    c.check_count(n_tensors, MAX_TENSORS, MIN_TENSOR_INFO_BYTES, || {
        "the tensor count".into()
    })?;
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut by_name = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let info = read_tensor_info(&mut c, i)?;
        if !info.offset.is_multiple_of(alignment) {
            return Err(GgufError::MisalignedTensor {
                path: path.into(),
                offset: info.offset,
                tensor: info.name,
                alignment,
            });
        }
        if by_name.insert(info.name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor {
                path: path.into(),
                tensor: info.name,
            });
        }
        // `offset` holds the relative offset until the data section's start is known.
        tensors.push(info);
    }
    let data_offset = (c.pos as u64)
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::LimitExceeded {
            path: path.into(),
            what: "the start of the data section".into(),
            value: c.pos as u64,
            limit: u64::MAX - alignment,
        })?;
    for info in &mut tensors {
        place_tensor(path, bytes.len() as u64, data_offset, info)?;
    }
    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
        by_name,
    })
}

/// Reads the magic and the version; only little-endian versions 2 and 3 are accepted.
fn read_version(c: &mut Cursor<'_>) -> Result<u32, GgufError> {
    let magic = c.take(4, Site::Header("magic"))?;
    if magic != b"GGUF" {
        return Err(GgufError::BadMagic {
            path: c.path.into(),
            found: magic.to_vec(),
        });
    }
    let version = c.u32(Site::Header("version"))?;
    match version {
        2 | 3 => Ok(version),
        v if matches!(v.swap_bytes(), 2 | 3) => Err(GgufError::BigEndian {
            path: c.path.into(),
            version: v.swap_bytes(),
        }),
        v => Err(GgufError::UnsupportedVersion {
            path: c.path.into(),
            version: v,
        }),
    }
}

fn read_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<BTreeMap<String, GgufValue>, GgufError> {
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(MAX_NAME_BYTES, Site::KeyName(i))?;
        let type_id = c.u32(Site::Value(key))?;
        let value = read_value(c, key, type_id, 0)?;
        if metadata.insert(key.to_owned(), value).is_some() {
            return Err(GgufError::DuplicateKey {
                path: c.path.into(),
                key: key.into(),
            });
        }
    }
    Ok(metadata)
}

/// Smallest encoding of a value of type `type_id`, or `None` for an unknown type.
fn min_value_bytes(type_id: u32) -> Option<u64> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // empty string: its length
        9 => 4 + 8, // empty array: element type and count
        10..=12 => 8,
        _ => return None,
    })
}

fn read_value(
    c: &mut Cursor<'_>,
    key: &str,
    type_id: u32,
    depth: usize,
) -> Result<GgufValue, GgufError> {
    c.values += 1;
    if c.values > MAX_METADATA_VALUES {
        let what = format!("the number of metadata values up to key {key}");
        return Err(c.limit(what, c.values, MAX_METADATA_VALUES));
    }
    let site = Site::Value(key);
    Ok(match type_id {
        0 => GgufValue::U8(u8::from_le_bytes(c.array(site)?)),
        1 => GgufValue::I8(i8::from_le_bytes(c.array(site)?)),
        2 => GgufValue::U16(u16::from_le_bytes(c.array(site)?)),
        3 => GgufValue::I16(i16::from_le_bytes(c.array(site)?)),
        4 => GgufValue::U32(u32::from_le_bytes(c.array(site)?)),
        5 => GgufValue::I32(i32::from_le_bytes(c.array(site)?)),
        6 => GgufValue::F32(f32::from_le_bytes(c.array(site)?)),
        7 => match c.array::<1>(site)?[0] {
            0 => GgufValue::Bool(false),
            1 => GgufValue::Bool(true),
            value => {
                return Err(GgufError::InvalidBool {
                    path: c.path.into(),
                    key: key.into(),
                    value,
                });
            }
        },
        8 => GgufValue::String(c.string(MAX_STRING_BYTES, site)?.to_owned()),
        9 => read_array(c, key, depth)?,
        10 => GgufValue::U64(u64::from_le_bytes(c.array(site)?)),
        11 => GgufValue::I64(i64::from_le_bytes(c.array(site)?)),
        12 => GgufValue::F64(f64::from_le_bytes(c.array(site)?)),
        _ => {
            return Err(GgufError::UnknownValueType {
                path: c.path.into(),
                key: key.into(),
                type_id,
            });
        }
    })
}

fn read_array(c: &mut Cursor<'_>, key: &str, depth: usize) -> Result<GgufValue, GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            path: c.path.into(),
            key: key.into(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let elem_type = c.u32(Site::Value(key))?;
    let Some(min_bytes) = min_value_bytes(elem_type) else {
        return Err(GgufError::UnknownValueType {
            path: c.path.into(),
            key: key.into(),
            type_id: elem_type,
        });
    };
    let count = c.u64(Site::Value(key))?;
    c.check_count(count, MAX_ARRAY_ELEMS, min_bytes, || {
        format!("the length of the array in metadata key {key}")
    })?;
    let mut items = Vec::with_capacity(count as usize);
    for _ in 0..count {
        items.push(read_value(c, key, elem_type, depth + 1)?);
    }
    Ok(GgufValue::Array(items))
}

/// `general.alignment`, or the default; it must be a power of two.
fn alignment(path: &Path, metadata: &BTreeMap<String, GgufValue>) -> Result<u64, GgufError> {
    const KEY: &str = "general.alignment";
    let Some(value) = metadata.get(KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let alignment = super::value_as_u64(path, KEY, value)?;
    if !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment {
            path: path.into(),
            alignment,
        });
    }
    Ok(alignment)
}

/// Reads one tensor info; its `offset` is still relative to the data section.
fn read_tensor_info(c: &mut Cursor<'_>, index: u64) -> Result<GgufTensorInfo, GgufError> {
    let name = c.string(MAX_NAME_BYTES, Site::TensorName(index))?;
    let n_dims = c.u32(Site::Tensor(name, "dimension count"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(GgufError::TensorRank {
            path: c.path.into(),
            tensor: name.into(),
            n_dims,
            max: MAX_DIMS,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(Site::Tensor(name, "dimensions"))?);
    }
    let type_id = c.u32(Site::Tensor(name, "type"))?;
    let rel_offset = c.u64(Site::Tensor(name, "data offset"))?;
    let Some(dtype) = DType::from_ggml_id(type_id) else {
        return Err(GgufError::UnsupportedType {
            path: c.path.into(),
            tensor: name.into(),
            type_id,
            type_name: ggml_type_name(type_id),
        });
    };
    let n_bytes = tensor_bytes(c.path, name, &dims, dtype)?;
    Ok(GgufTensorInfo {
        name: name.into(),
        dims,
        dtype,
        offset: rel_offset,
        n_bytes,
    })
}

/// Bytes of a tensor of `dims` (GGML order) and `dtype`, with every overflow checked.
fn tensor_bytes(path: &Path, name: &str, dims: &[u64], dtype: DType) -> Result<usize, GgufError> {
    let too_large = || GgufError::TensorTooLarge {
        path: path.into(),
        tensor: name.into(),
        dims: dims.to_vec(),
    };
    let cols = dims.first().copied().unwrap_or(1);
    // GGML counts elements in i64; anything past that is not a tensor GGML could write.
    let n_elements = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(too_large)?;
    let block_elems = dtype.block_elems() as u64;
    if !cols.is_multiple_of(block_elems) {
        return Err(GgufError::PartialBlock {
            path: path.into(),
            tensor: name.into(),
            dtype,
            cols,
            block_elems: dtype.block_elems(),
        });
    }
    (n_elements / block_elems)
        .checked_mul(dtype.block_bytes() as u64)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(too_large)
}

/// Turns `info.offset` from relative to absolute and checks the tensor lies inside the file.
fn place_tensor(
    path: &Path,
    file_bytes: u64,
    data_offset: u64,
    info: &mut GgufTensorInfo,
) -> Result<(), GgufError> {
    let start = data_offset.checked_add(info.offset);
    let end = start.and_then(|s| s.checked_add(info.n_bytes as u64));
    match (start, end) {
        (Some(start), Some(end)) if end <= file_bytes => {
            info.offset = start;
            Ok(())
        }
        _ => Err(GgufError::TensorOutOfBounds {
            path: path.into(),
            tensor: info.name.clone(),
            start: start.unwrap_or(u64::MAX),
            end: end.unwrap_or(u64::MAX),
            file_bytes,
        }),
    }
}
