//! The GGUF reader on malformed and hostile headers and metadata: each must give an error that
//! names the file (and the key at fault), never a panic or an allocation the file cannot
//! justify. Tensor directory and data faults are in `gguf_malformed_tensors.rs`; files are
//! built byte by byte with the writer in `gguf_writer/`.

mod gguf_writer;

use std::path::PathBuf;

use gguf_writer::*;
use tessera_kernels::DType;
use tessera_model::gguf::parse::{MAX_ARRAY_ELEMS, MAX_STRING_BYTES, MAX_TENSORS};
use tessera_model::gguf::{GgufError, GgufFile};

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
