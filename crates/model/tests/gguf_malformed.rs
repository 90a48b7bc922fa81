//! The GGUF reader on malformed and hostile files: each must give an error that names the
//! file (and the tensor or key at fault), never a panic or an allocation the file cannot
//! justify. Files are built here byte by byte with a small writer.

use std::path::{Path, PathBuf};

use tessera_kernels::DType;
use tessera_model::gguf::parse::{MAX_ARRAY_ELEMS, MAX_STRING_BYTES, MAX_TENSORS};
use tessera_model::gguf::{GgufError, GgufFile, GgufValue};

// GGUF value type ids.
const T_U8: u32 = 0;
const T_U32: u32 = 4;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

/// Little-endian encoding helpers.
fn le32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn gstr(s: &str) -> Vec<u8> {
    [le64(s.len() as u64), s.as_bytes().to_vec()].concat()
}

struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    n_bytes: usize,
    /// Relative data offset; `None` places it after the previous tensor, aligned.
    offset: Option<u64>,
}

/// A GGUF file under construction.
struct Gguf {
    version: u32,
    /// Encoded metadata entries (key, type, value).
    kvs: Vec<Vec<u8>>,
    tensors: Vec<TensorSpec>,
    alignment: u64,
}

impl Gguf {
    fn new() -> Gguf {
        Gguf {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    /// A metadata entry with an already encoded value.
    fn kv(mut self, key: &str, type_id: u32, value: Vec<u8>) -> Gguf {
        self.kvs.push([gstr(key), le32(type_id), value].concat());
        self
    }

    fn kv_u32(self, key: &str, v: u32) -> Gguf {
        self.kv(key, T_U32, le32(v))
    }

    fn kv_str(self, key: &str, s: &str) -> Gguf {
        self.kv(key, T_STRING, gstr(s))
    }

    fn kv_strs(self, key: &str, items: &[&str]) -> Gguf {
        let mut value = [le32(T_STRING), le64(items.len() as u64)].concat();
        for s in items {
            value.extend(gstr(s));
        }
        self.kv(key, T_ARRAY, value)
    }

    fn alignment(mut self, alignment: u32) -> Gguf {
        self.alignment = u64::from(alignment);
        self.kv_u32("general.alignment", alignment)
    }

    fn tensor(self, name: &str, dims: &[u64], dtype: DType) -> Gguf {
        let rows: u64 = dims[1..].iter().product();
        let n_bytes = dtype.row_bytes(dims[0] as usize).unwrap() * rows as usize;
        self.raw_tensor(name, dims, dtype.ggml_id(), n_bytes, None)
    }

    fn raw_tensor(
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

    fn bytes(&self) -> Vec<u8> {
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
fn valid() -> Gguf {
    Gguf::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_strs("tokenizer.ggml.tokens", &["<s>", "a", "b"])
        .kv("flag", T_BOOL, vec![1])
        .tensor("token_embd.weight", &[64, 3], DType::Q8_0)
        .tensor("blk.0.ffn_up.weight", &[256, 2, 3], DType::Q4K)
        .tensor("output_norm.weight", &[64], DType::F32)
}

struct Scratch {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn scratch() -> Scratch {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    Scratch { _dir: dir, path }
}

fn open_bytes(s: &Scratch, bytes: &[u8]) -> Result<GgufFile, GgufError> {
    std::fs::write(&s.path, bytes).unwrap();
    GgufFile::open(&s.path)
}

/// Opens `bytes`, expects an error, checks it names the file and each of `names`.
fn open_err(bytes: &[u8], names: &[&str]) -> GgufError {
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

#[test]
fn the_valid_file_opens() {
    let s = scratch();
    let file = open_bytes(&s, &valid().bytes()).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.metadata().len(), 4);
    assert_eq!(
        file.get_str_array("tokenizer.ggml.tokens").unwrap(),
        Some(vec!["<s>", "a", "b"])
    );
    assert_eq!(file.get_bool("flag").unwrap(), Some(true));
    let up = file.tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!((up.cols(), up.rows(), up.dtype), (256, 6, DType::Q4K));
    assert_eq!(up.n_bytes, 6 * 144);
    assert_eq!(up.offset % 32, 0);
    assert!(up.offset >= file.data_offset());
    let data = file.tensor_data(up);
    assert_eq!(data.len(), 6 * 144);
    assert_eq!(data[..3], [31, 32, 33]); // tensor 1's pattern starts at 31
    assert_eq!(file.tensor_rows(up, 2..4).unwrap(), &data[2 * 144..4 * 144]);
    assert!(file.tensor_rows(up, 5..5).unwrap().is_empty());
    let norm = file.tensor("output_norm.weight").unwrap();
    assert_eq!((norm.cols(), norm.rows()), (64, 1));
    assert_eq!(file.tensors().len(), 3);
    assert!(file.tensor("missing").is_none());
}

#[test]
fn row_ranges_outside_the_tensor_are_errors() {
    let s = scratch();
    let file = open_bytes(&s, &valid().bytes()).unwrap();
    let up = file.tensor("blk.0.ffn_up.weight").unwrap().clone();
    for range in [0..7, 6..7, 7..7, usize::MAX - 1..usize::MAX] {
        let err = file.tensor_rows(&up, range.clone()).unwrap_err();
        assert!(
            matches!(err, GgufError::RowRange { .. }),
            "{range:?}: {err}"
        );
        assert!(err.to_string().contains("blk.0.ffn_up.weight"), "{err}");
    }
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 3..2;
    assert!(file.tensor_rows(&up, backwards).is_err());
    // An info that is not from this file gives no bytes rather than a panic.
    let mut foreign = up.clone();
    foreign.offset = u64::MAX - 4;
    assert!(file.tensor_data(&foreign).is_empty());
    assert!(file.tensor_rows(&foreign, 0..1).is_err());
}

#[test]
fn version_2_is_accepted() {
    let mut g = valid();
    g.version = 2;
    let s = scratch();
    assert_eq!(open_bytes(&s, &g.bytes()).unwrap().version(), 2);
}

#[test]
fn missing_file_and_directory() {
    let s = scratch();
    let err = GgufFile::open(&s.path).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }));
    assert!(
        err.to_string().starts_with(&s.path.display().to_string()),
        "{err}"
    );
    let dir = s.path.parent().unwrap();
    let err = GgufFile::open(dir).unwrap_err();
    assert!(err.to_string().contains("is a directory"), "{err}");
}

#[test]
fn empty_file_and_bad_magic() {
    let err = open_err(&[], &["magic"]);
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    let mut bytes = valid().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let err = open_err(&bytes, &["not a GGUF file"]);
    assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, u32::MAX] {
        let mut g = valid();
        g.version = version;
        let err = open_err(&g.bytes(), &[&format!("version {version}")]);
        assert!(matches!(err, GgufError::UnsupportedVersion { .. }), "{err}");
    }
    let mut g = valid();
    g.version = 3u32.swap_bytes();
    let err = open_err(&g.bytes(), &["big-endian"]);
    assert!(
        matches!(err, GgufError::BigEndian { version: 3, .. }),
        "{err}"
    );
}

#[test]
fn truncation_at_every_cut_point_is_an_error() {
    let bytes = valid().bytes();
    let s = scratch();
    let full = open_bytes(&s, &bytes).unwrap();
    // Past the end of the last tensor the file only loses padding, which is allowed.
    let last_end = full
        .tensors()
        .iter()
        .map(|t| t.offset as usize + t.n_bytes)
        .max()
        .unwrap();
    drop(full);
    let path = s.path.display().to_string();
    for cut in 0..bytes.len() {
        match open_bytes(&s, &bytes[..cut]) {
            Ok(_) => assert!(cut >= last_end, "cut at {cut} of {} opened", bytes.len()),
            Err(err) => {
                assert!(err.to_string().starts_with(&path), "cut {cut}: {err}");
            }
        }
    }
}

#[test]
fn truncating_the_gguf_py_fixture_is_an_error() {
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/all-types.gguf");
    let bytes = std::fs::read(&fixture).unwrap();
    let data_offset = GgufFile::open(&fixture).unwrap().data_offset() as usize;
    let s = scratch();
    // Every cut in the header, metadata and directory; then every 997th byte of the data.
    let cuts = (0..=data_offset).chain((data_offset..bytes.len()).step_by(997));
    for cut in cuts {
        let err = open_bytes(&s, &bytes[..cut]).expect_err("truncated fixture opened");
        assert!(
            err.to_string().starts_with(&s.path.display().to_string()),
            "{err}"
        );
    }
}

#[test]
fn huge_string_lengths_are_refused_before_allocating() {
    let bytes = Gguf::new()
        .kv("general.name", T_STRING, le64(u64::MAX))
        .bytes();
    let err = open_err(&bytes, &["general.name", &MAX_STRING_BYTES.to_string()]);
    assert!(matches!(err, GgufError::LimitExceeded { .. }), "{err}");
    // Under the limit but longer than the file.
    let bytes = Gguf::new()
        .kv("general.name", T_STRING, le64(1 << 20))
        .bytes();
    let err = open_err(&bytes, &["general.name"]);
    assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    // A key name of absurd length.
    let mut bytes = Gguf::new().kv_u32("k", 1).bytes();
    bytes[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = open_err(&bytes, &["metadata entry #0"]);
    assert!(matches!(err, GgufError::LimitExceeded { .. }), "{err}");
}

#[test]
fn huge_array_lengths_are_refused_before_allocating() {
    let array = |elem: u32, count: u64| [le32(elem), le64(count)].concat();
    let bytes = Gguf::new()
        .kv("tokenizer.ggml.tokens", T_ARRAY, array(T_STRING, u64::MAX))
        .bytes();
    let err = open_err(
        &bytes,
        &["tokenizer.ggml.tokens", &MAX_ARRAY_ELEMS.to_string()],
    );
    assert!(matches!(err, GgufError::LimitExceeded { .. }), "{err}");
    // Under the limit, but more than the rest of the file can hold.
    let bytes = Gguf::new()
        .kv(
            "tokenizer.ggml.scores",
            T_ARRAY,
            array(T_U8, MAX_ARRAY_ELEMS - 1),
        )
        .bytes();
    let err = open_err(&bytes, &["tokenizer.ggml.scores"]);
    assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
    // Arrays nested past the depth limit.
    let mut value = array(T_U8, 0);
    for _ in 0..8 {
        value = [array(T_ARRAY, 1), value].concat();
    }
    let bytes = Gguf::new().kv("deep", T_ARRAY, value).bytes();
    let err = open_err(&bytes, &["deep"]);
    assert!(matches!(err, GgufError::NestingTooDeep { .. }), "{err}");
}

#[test]
fn huge_counts_are_refused() {
    let mut bytes = Gguf::new().bytes();
    bytes[8..16].copy_from_slice(&(MAX_TENSORS + 1).to_le_bytes());
    let err = open_err(&bytes, &["tensor count"]);
    assert!(matches!(err, GgufError::LimitExceeded { .. }), "{err}");
    bytes[8..16].copy_from_slice(&1000u64.to_le_bytes());
    let err = open_err(&bytes, &["tensor count"]);
    assert!(matches!(err, GgufError::CountTooLarge { .. }), "{err}");
    let mut bytes = Gguf::new().bytes();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = open_err(&bytes, &["metadata count"]);
    assert!(matches!(err, GgufError::LimitExceeded { .. }), "{err}");
}

#[test]
fn bad_metadata_values() {
    let err = open_err(
        &Gguf::new().kv("k.odd", 13, vec![0; 8]).bytes(),
        &["k.odd", "13"],
    );
    assert!(matches!(err, GgufError::UnknownValueType { .. }), "{err}");
    let err = open_err(
        &Gguf::new().kv("k.bool", T_BOOL, vec![2]).bytes(),
        &["k.bool"],
    );
    assert!(
        matches!(err, GgufError::InvalidBool { value: 2, .. }),
        "{err}"
    );
    let bytes = Gguf::new()
        .kv("k.str", T_STRING, [le64(2), vec![0xff, 0xfe]].concat())
        .bytes();
    let err = open_err(&bytes, &["k.str", "UTF-8"]);
    assert!(matches!(err, GgufError::InvalidUtf8 { .. }), "{err}");
    let bytes = Gguf::new().kv_u32("k.dup", 1).kv_u32("k.dup", 2).bytes();
    let err = open_err(&bytes, &["k.dup", "twice"]);
    assert!(matches!(err, GgufError::DuplicateKey { .. }), "{err}");
}

#[test]
fn unknown_tensor_type_names_the_tensor_and_type() {
    let bytes = Gguf::new()
        .raw_tensor("blk.0.ffn_up.weight", &[256, 2], 16, 132, None)
        .bytes();
    let s = scratch();
    let err = open_bytes(&s, &bytes).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: tensor blk.0.ffn_up.weight has GGML type 16 (IQ2_XXS), which Tessera does not \
             support; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1, Q5_K, \
             Q3_K, Q2_K, IQ4_NL, IQ4_XS",
            s.path.display()
        )
    );
    let bytes = Gguf::new().raw_tensor("t", &[32], 9999, 32, None).bytes();
    open_err(&bytes, &["tensor t", "9999 (unknown)"]);
}

#[test]
fn tensor_data_out_of_bounds() {
    let bytes = Gguf::new()
        .raw_tensor(
            "far.weight",
            &[64],
            DType::F32.ggml_id(),
            256,
            Some(1 << 20),
        )
        .bytes();
    let err = open_err(&bytes, &["far.weight"]);
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
    // An offset whose sum with the data start overflows.
    let bytes = Gguf::new()
        .raw_tensor(
            "wrap.weight",
            &[64],
            DType::F32.ggml_id(),
            256,
            Some(u64::MAX - 31),
        )
        .bytes();
    let err = open_err(&bytes, &["wrap.weight"]);
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
    // The last tensor's data cut short.
    let mut bytes = valid().bytes();
    bytes.truncate(bytes.len() - 64);
    let err = open_err(&bytes, &["output_norm.weight"]);
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
}

#[test]
fn misaligned_offset() {
    let bytes = Gguf::new()
        .raw_tensor("a", &[64], DType::F32.ggml_id(), 256, Some(16))
        .bytes();
    let err = open_err(&bytes, &["tensor a", "16", "32"]);
    assert!(matches!(err, GgufError::MisalignedTensor { .. }), "{err}");
}

#[test]
fn duplicate_tensor_name() {
    let bytes = Gguf::new()
        .tensor("same.weight", &[32], DType::F32)
        .tensor("same.weight", &[32], DType::F32)
        .bytes();
    let err = open_err(&bytes, &["same.weight", "twice"]);
    assert!(matches!(err, GgufError::DuplicateTensor { .. }), "{err}");
}

#[test]
fn alignment_is_honoured_and_checked() {
    let s = scratch();
    let g = valid().alignment(256);
    let file = open_bytes(&s, &g.bytes()).unwrap();
    assert_eq!(file.alignment(), 256);
    assert_eq!(file.data_offset() % 256, 0);
    for t in file.tensors() {
        assert_eq!(t.offset % 256, 0, "{}", t.name);
    }
    // A 32-aligned offset is misaligned under alignment 256.
    let bytes = Gguf::new()
        .alignment(256)
        .raw_tensor("b", &[8], DType::F32.ggml_id(), 32, Some(32))
        .bytes();
    open_err(&bytes, &["tensor b"]);
    for bad in [0, 48] {
        let bytes = Gguf::new().kv_u32("general.alignment", bad).bytes();
        let err = open_err(&bytes, &["general.alignment"]);
        assert!(matches!(err, GgufError::BadAlignment { .. }), "{err}");
    }
    let bytes = Gguf::new().kv_str("general.alignment", "32").bytes();
    let err = open_err(&bytes, &["general.alignment"]);
    assert!(matches!(err, GgufError::WrongType { .. }), "{err}");
}

#[test]
fn bad_shapes() {
    let q4k = DType::Q4K.ggml_id();
    let err = open_err(
        &Gguf::new()
            .raw_tensor("p", &[128, 2], q4k, 144, None)
            .bytes(),
        &["p"],
    );
    assert!(
        matches!(err, GgufError::PartialBlock { cols: 128, .. }),
        "{err}"
    );
    let f32_id = DType::F32.ggml_id();
    for dims in [&[][..], &[1, 1, 1, 1, 1][..]] {
        let bytes = Gguf::new().raw_tensor("r", dims, f32_id, 4, None).bytes();
        let err = open_err(&bytes, &["tensor r"]);
        assert!(matches!(err, GgufError::TensorRank { .. }), "{err}");
    }
    let huge = 1u64 << 32;
    let bytes = Gguf::new()
        .raw_tensor("o", &[huge, huge, huge], f32_id, 0, None)
        .bytes();
    let err = open_err(&bytes, &["tensor o"]);
    assert!(matches!(err, GgufError::TensorTooLarge { .. }), "{err}");
    // Fits in the element count but not in bytes.
    let bytes = Gguf::new()
        .raw_tensor("b", &[1 << 62, 1], f32_id, 0, None)
        .bytes();
    let err = open_err(&bytes, &["tensor b"]);
    assert!(matches!(err, GgufError::TensorTooLarge { .. }), "{err}");
}

/// A deterministic xorshift generator, so the corruption test needs no extra crate.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_corruption_never_panics() {
    let clean = valid().alignment(64).bytes();
    let s = scratch();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let header_bytes = {
        let file = open_bytes(&s, &clean).unwrap();
        file.data_offset() as usize
    };
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..3000 {
        let mut bytes = clean.clone();
        // Corrupt 1-4 bytes of the header, metadata or directory, sometimes with an extreme value.
        for _ in 0..1 + rng.next() % 4 {
            let at = (rng.next() % header_bytes as u64) as usize;
            bytes[at] = match rng.next() % 3 {
                0 => 0xff,
                1 => 0,
                _ => rng.next() as u8,
            };
        }
        match open_bytes(&s, &bytes) {
            Ok(file) => {
                // Whatever opened must be internally consistent.
                for t in file.tensors() {
                    assert_eq!(file.tensor_data(t).len(), t.n_bytes);
                }
                ok += 1;
            }
            Err(err) => {
                assert!(
                    err.to_string().starts_with(&s.path.display().to_string()),
                    "{err}"
                );
                failed += 1;
            }
        }
    }
    assert!(
        failed > 1000,
        "only {failed} corruptions were caught ({ok} opened)"
    );
}

#[test]
fn path_is_kept() {
    let s = scratch();
    let file = open_bytes(&s, &valid().bytes()).unwrap();
    assert_eq!(file.path(), Path::new(&s.path));
    assert!(matches!(file.get("flag"), Some(GgufValue::Bool(true))));
    assert!(format!("{file:?}").contains("tensors: 3"));
}
