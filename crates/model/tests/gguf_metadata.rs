//! Metadata of `fixtures/quant/all-types.gguf`, which gguf-py wrote with one key of each GGUF
//! value type: the reader must agree with gguf-py's writer on every one, and the typed getters
//! must convert what fits and refuse what does not.

use std::path::PathBuf;

use tessera_kernels::DType;
use tessera_model::gguf::{GgufError, GgufFile, GgufValue};

fn open_fixture() -> GgufFile {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/all-types.gguf");
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{e} (run make_quant_fixtures.py?)"))
}

const K: &str = "tessera.fixture";

fn key(name: &str) -> String {
    format!("{K}.{name}")
}

#[test]
fn header_and_provenance() {
    let file = open_fixture();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset() % 32, 0);
    assert_eq!(
        file.get_str("general.architecture").unwrap(),
        Some("tessera-fixture")
    );
    let version = file.get_str(&key("gguf_py_version")).unwrap().unwrap();
    assert!(!version.is_empty());
    assert!(file.get_u32(&key("seed")).unwrap().is_some());
    // Each type and its `.expected` twin.
    assert_eq!(file.tensors().len(), 2 * DType::GGML.len());
}

#[test]
fn every_value_type_reads_as_written() {
    let file = open_fixture();
    let cases = [
        ("u8", GgufValue::U8(200)),
        ("i8", GgufValue::I8(-100)),
        ("u16", GgufValue::U16(60000)),
        ("i16", GgufValue::I16(-30000)),
        ("i32", GgufValue::I32(-2_000_000_000)),
        ("u64", GgufValue::U64((1 << 40) + 3)),
        ("i64", GgufValue::I64(-(1 << 40))),
        ("f32", GgufValue::F32(0.15625)),
        ("f64", GgufValue::F64(2.5)),
        ("flag", GgufValue::Bool(true)),
    ];
    for (name, want) in cases {
        assert_eq!(file.get(&key(name)), Some(&want), "{name}");
    }
    assert_eq!(
        file.get_str_array(&key("strings")).unwrap(),
        Some(vec!["alpha", "", "grüße"])
    );
    assert_eq!(
        file.get_f32_array(&key("f32s")).unwrap(),
        Some(vec![0.5, -1.25, 3.0])
    );
    assert_eq!(
        file.get_i32_array(&key("i32s")).unwrap(),
        Some(vec![-7, 0, i32::MAX])
    );
}

#[test]
fn typed_getters_convert_what_fits() {
    let file = open_fixture();
    assert_eq!(file.get_u32(&key("u8")).unwrap(), Some(200));
    assert_eq!(file.get_u32(&key("u16")).unwrap(), Some(60000));
    assert_eq!(file.get_u64(&key("u64")).unwrap(), Some((1 << 40) + 3));
    assert_eq!(file.get_f32(&key("f64")).unwrap(), Some(2.5));
    assert_eq!(file.get_f32(&key("f32")).unwrap(), Some(0.15625));
    assert_eq!(file.get_bool(&key("flag")).unwrap(), Some(true));
    assert_eq!(file.get_u32("no.such.key").unwrap(), None);
    assert_eq!(file.get_str_array("no.such.key").unwrap(), None);
}

#[test]
fn typed_getters_refuse_what_does_not_fit() {
    let file = open_fixture();
    let path = file.path().display().to_string();
    let err = file.get_u32(&key("i8")).unwrap_err();
    assert!(matches!(err, GgufError::OutOfRange { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        format!("{path}: metadata key {K}.i8 = -100 does not fit in u32")
    );
    assert!(matches!(
        file.get_u32(&key("u64")),
        Err(GgufError::OutOfRange { .. })
    ));
    let err = file.get_str(&key("u8")).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("{path}: metadata key {K}.u8 is a u8, expected a string")
    );
    assert!(matches!(
        file.get_bool(&key("u8")),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        file.get_f32(&key("u8")),
        Err(GgufError::WrongType { .. })
    ));
    let err = file.get_str_array(&key("f32s")).unwrap_err();
    assert!(err.to_string().contains("element 0 is an f32"), "{err}");
    assert!(matches!(
        file.get_i32_array(&key("strings")),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        file.get_f32_array(&key("i32s")),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        file.get_str_array(&key("u8")),
        Err(GgufError::WrongType { .. })
    ));
}
