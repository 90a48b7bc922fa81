//! The block formats of `tessera_kernels::quant` against gguf-py, bit for bit, on
//! `fixtures/quant/all-types.gguf` (written by `scripts/fixtures/make_quant_fixtures.py`):
//! every tensor `<name>` of each supported type sits beside `<name>.expected`, gguf-py's
//! dequantization of it as F32.

use std::path::PathBuf;

use tessera_kernels::{DType, quant};
use tessera_model::gguf::{GgufFile, GgufTensorInfo};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/all-types.gguf")
}

fn open_fixture() -> GgufFile {
    let path = fixture();
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{e} (run make_quant_fixtures.py?)"))
}

/// Row `r` of an F32 tensor, read without the code under test.
fn f32_row(file: &GgufFile, info: &GgufTensorInfo, r: usize) -> Vec<f32> {
    assert_eq!(info.dtype, DType::F32, "{}", info.name);
    let bytes = file.tensor_rows(info, r..r + 1).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The tensors under test with their expected twins.
fn pairs(file: &GgufFile) -> Vec<(&GgufTensorInfo, &GgufTensorInfo)> {
    let pairs: Vec<_> = file
        .tensors()
        .iter()
        .filter(|t| !t.name.ends_with(".expected"))
        .map(|t| {
            let expected = file
                .tensor(&format!("{}.expected", t.name))
                .unwrap_or_else(|| panic!("{} has no .expected twin", t.name));
            assert_eq!(expected.dims, t.dims, "{}", t.name);
            (t, expected)
        })
        .collect();
    for dtype in DType::GGML {
        assert!(
            pairs.iter().any(|(t, _)| t.dtype == dtype),
            "the fixture has no {dtype} tensor"
        );
    }
    pairs
}

#[test]
fn dequantize_row_is_bit_exact_with_gguf_py() {
    let file = open_fixture();
    for (info, expected) in pairs(&file) {
        assert!(info.rows() >= 4, "{}", info.name);
        let mut got = vec![0.0f32; info.cols()];
        for r in 0..info.rows() {
            let row = file.tensor_rows(info, r..r + 1).unwrap();
            quant::dequantize_row(info.dtype, row, &mut got).unwrap();
            let want = f32_row(&file, expected, r);
            for (c, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{} ({}) row {r} col {c}: got {g:e}, gguf-py {w:e}",
                    info.name,
                    info.dtype
                );
            }
        }
    }
}

#[test]
fn dot_row_matches_dequantize_then_dot() {
    let file = open_fixture();
    for (info, _) in pairs(&file) {
        let cols = info.cols();
        // Deterministic, varied activations in [-1, 1).
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 7919 + 13) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut w = vec![0.0f32; cols];
        let mut checked = 0;
        for r in 0..info.rows() {
            let row = file.tensor_rows(info, r..r + 1).unwrap();
            quant::dequantize_row(info.dtype, row, &mut w).unwrap();
            let want: f64 = w
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            // Row 3 of the float tensors holds raw bit patterns, infinities included.
            if !want.is_finite() || want.abs() > f64::from(f32::MAX) {
                continue;
            }
            let got = f64::from(quant::dot_row(info.dtype, row, &x).unwrap());
            assert!(
                (got - want).abs() <= 1e-5 * want.abs() + 1e-30,
                "{} row {r}: dot_row {got:e} vs {want:e}",
                info.name
            );
            checked += 1;
        }
        assert!(
            checked >= 3,
            "{}: only {checked} rows had a finite dot",
            info.name
        );
    }
}

#[test]
fn rows_are_contiguous_slices_of_the_tensor() {
    let file = open_fixture();
    for (info, _) in pairs(&file) {
        let all = file.tensor_data(info);
        assert_eq!(all.len(), info.n_bytes);
        assert_eq!(
            info.n_bytes,
            info.dtype.row_bytes(info.cols()).unwrap() * info.rows()
        );
        let two = file.tensor_rows(info, 1..3).unwrap();
        let row_bytes = info.n_bytes / info.rows();
        assert_eq!(two, &all[row_bytes..3 * row_bytes], "{}", info.name);
    }
}
