//! The GGUF reader on malformed tensor directories and data: unknown types, data out of
//! bounds, bad offsets, alignment and shapes, and random corruption. Each must give an error
//! that names the file and the tensor, never a panic. Header and metadata faults are in
//! `gguf_malformed.rs`.

mod gguf_writer;

use std::path::Path;

use gguf_writer::*;
use tessera_kernels::DType;
use tessera_model::gguf::{GgufError, GgufValue};

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
            DType::F32.ggml_id().unwrap(),
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
            DType::F32.ggml_id().unwrap(),
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
        .raw_tensor("a", &[64], DType::F32.ggml_id().unwrap(), 256, Some(16))
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
        .raw_tensor("b", &[8], DType::F32.ggml_id().unwrap(), 32, Some(32))
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
    let q4k = DType::Q4K.ggml_id().unwrap();
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
    let f32_id = DType::F32.ggml_id().unwrap();
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
