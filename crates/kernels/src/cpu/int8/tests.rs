use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::quant;
use crate::quant::k_quants::{Q6_K_D_OFFSET, Q6_K_SCALES_OFFSET, QK_K};
use crate::quant::k_quants_small::{Q2_K_D_OFFSET, Q3_K_D_OFFSET};

const TYPES: [DType; 12] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::IQ4NL,
    DType::IQ4XS,
];

/// `rows` random rows of `cols` values of `dtype`: random bytes, with every block's f16
/// scale (and Q4_1 min, Q4_K and Q5_K dmin) set to a finite value.
fn random_rows(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = dtype.block_bytes();
    let blocks = rows * cols / dtype.block_elems();
    let mut data: Vec<u8> = (0..blocks * bytes).map(|_| rng.random()).collect();
    for block in data.chunks_exact_mut(bytes) {
        // Q6_K's and Q3_K's f16 `d` comes last, Q2_K's `d` and `dmin` too.
        let last = match dtype {
            DType::Q6K => Some(Q6_K_D_OFFSET),
            DType::Q3K => Some(Q3_K_D_OFFSET),
            DType::Q2K => Some(Q2_K_D_OFFSET),
            _ => None,
        };
        if let Some(at) = last {
            for field in block[at..].chunks_exact_mut(2) {
                let value = half::f16::from_f32(rng.random_range(-0.05f32..0.05)).to_bits();
                field.copy_from_slice(&value.to_le_bytes());
            }
            continue;
        }
        let scales = if matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K) {
            2
        } else {
            1
        };
        for s in 0..scales {
            let value = half::f16::from_f32(rng.random_range(-0.05f32..0.05)).to_bits();
            block[2 * s..2 * s + 2].copy_from_slice(&value.to_le_bytes());
        }
    }
    data
}

fn random_acts(rng: &mut StdRng, n: usize, cols: usize) -> Vec<f32> {
    (0..n * cols)
        .map(|i| {
            // Mostly small values, a few outliers, one all-zero block.
            if (i / 32) % 7 == 3 {
                0.0
            } else if i % 97 == 0 {
                rng.random_range(-40.0..40.0)
            } else {
                rng.random_range(-1.0..1.0)
            }
        })
        .collect()
}

#[test]
fn blocks_quantize_to_within_half_a_step() {
    let mut rng = StdRng::seed_from_u64(5);
    let xs = random_acts(&mut rng, 3, 96);
    let acts = Q8Acts::quantize(&xs, 96).unwrap();
    assert_eq!((acts.len(), acts.cols()), (3, 96));
    for t in 0..3 {
        let row = acts.row(t);
        for (b, x) in xs[t * 96..][..96].chunks_exact(32).enumerate() {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(row.d[b], amax / 127.0);
            let q = &row.qs[b * 32..][..32];
            assert_eq!(
                q.iter().map(|q| q.unsigned_abs()).max(),
                Some(if amax > 0.0 { 127 } else { 0 })
            );
            for (x, q) in x.iter().zip(q) {
                assert!((x - row.d[b] * f32::from(*q)).abs() <= row.d[b] / 2.0 * 1.0001);
            }
            let sum: i32 = q.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(row.dsum[b], row.d[b] * sum as f32);
            for (h, q) in q.chunks(16).enumerate() {
                assert_eq!(
                    row.hsum[2 * b + h],
                    q.iter().map(|&q| i32::from(q)).sum::<i32>()
                );
            }
        }
    }
    assert!(Q8Acts::quantize(&xs[..40], 40).is_err(), "not whole blocks");
    assert!(
        Q8Acts::quantize(&xs[..70], 64).is_err(),
        "not whole vectors"
    );
}

#[test]
fn the_reference_is_the_dot_of_the_dequantized_values() {
    let mut rng = StdRng::seed_from_u64(6);
    for dtype in TYPES {
        let cols = 256;
        let row = random_rows(&mut rng, dtype, 1, cols);
        let xs = random_acts(&mut rng, 1, cols);
        let acts = Q8Acts::quantize(&xs, cols).unwrap();
        let mut w = vec![0.0f32; cols];
        quant::dequantize_row(dtype, &row, &mut w).unwrap();
        let x = acts.row(0);
        let exact: f64 = (0..cols)
            .map(|i| f64::from(w[i]) * f64::from(x.d[i / 32]) * f64::from(x.qs[i]))
            .sum();
        let got = dot_reference(dtype, &row, x).unwrap();
        let scale: f64 = (0..cols)
            .map(|i| (f64::from(w[i]) * f64::from(xs[i])).abs())
            .sum();
        assert!(
            (f64::from(got) - exact).abs() <= 1e-5 * scale.max(1e-6),
            "{dtype:?}: {got} vs {exact}"
        );
    }
}

/// Summed in f32 and in f64 ([`Sum`]): every path gives the reference's bits.
#[test]
fn every_path_gives_the_reference_bits_whatever_the_batch() {
    every_path_gives_the_reference_bits::<f32>();
    every_path_gives_the_reference_bits::<f64>();
}

fn every_path_gives_the_reference_bits<S: Sum + Into<f64>>() {
    let mut rng = StdRng::seed_from_u64(7);
    let features = Features::get();
    for dtype in TYPES {
        let k_quant = dtype.block_elems() == QK_K;
        let sizes = [256, 768, 1536].map(|c| if k_quant { c } else { c * 3 / 4 });
        // 1 to 3 blocks past the last whole quad (32, 96 and 224 values; 576), and none;
        // whole octets alone (256), and followed by 5 and 7 blocks (416, 480).
        for cols in [32, 96, 224, 256, 416, 480]
            .into_iter()
            .filter(|_| !k_quant)
            .chain(sizes)
        {
            let rows = 5;
            let data = random_rows(&mut rng, dtype, rows, cols);
            let n = Q8Acts::GROUP + 2;
            let acts = Q8Acts::quantize(&random_acts(&mut rng, n, cols), cols).unwrap();
            let row_bytes = dtype.row_bytes(cols).unwrap();
            let reference: Vec<S> = (0..rows)
                .flat_map(|r| {
                    let row = &data[r * row_bytes..][..row_bytes];
                    (0..n).map(move |t| (r, t, row))
                })
                .map(|(_, t, row)| dot_reference_in(dtype, row, acts.row(t)).unwrap())
                .collect();
            // The whole batch (a group, then singles), and each vector alone.
            let mut all = vec![S::default(); rows * n];
            acts.dot_rows(dtype, &data, 0, n, &mut all).unwrap();
            let mut alone = vec![S::default(); rows * n];
            for t in 0..n {
                acts.dot_rows(dtype, &data, t, 1, &mut alone).unwrap();
            }
            // f32 → f64 keeps every bit.
            let bits = |v: &[S]| v.iter().map(|&f| f.into().to_bits()).collect::<Vec<_>>();
            let what = format!("{dtype:?} cols {cols} on {features:?}, wide {}", S::WIDE);
            assert_eq!(bits(&all), bits(&reference), "batched: {what}");
            assert_eq!(bits(&alone), bits(&reference), "one at a time: {what}");
            #[cfg(target_arch = "x86_64")]
            if features.vnni {
                // The AVX2 kernels too, where VNNI took their place above.
                let avx2 = Features {
                    vnni: false,
                    ..features
                };
                let kernels = Kernels::for_type(dtype, avx2, S::WIDE);
                let want = |r: usize, t: usize| S::to_f64(reference[r * n + t]).to_bits();
                for t in 0..n {
                    let mut ys = vec![[0.0; 1]; rows];
                    let one = kernels.simd.map(|(_, one)| one);
                    run_rows::<S, 1>(one, dtype, &data, row_bytes, [acts.row(t)], &mut ys);
                    for (r, y) in ys.iter().enumerate() {
                        assert_eq!(y[0].to_bits(), want(r, t), "avx2: {what}");
                    }
                }
                let mut ys = vec![[0.0; Q8Acts::GROUP]; rows];
                let xs = std::array::from_fn(|t| acts.row(t));
                let group = kernels.simd.map(|(group, _)| group);
                run_rows::<S, { Q8Acts::GROUP }>(group, dtype, &data, row_bytes, xs, &mut ys);
                for (r, y) in ys.iter().enumerate() {
                    for (t, y) in y.iter().enumerate() {
                        assert_eq!(y.to_bits(), want(r, t), "avx2 group: {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn bad_lengths_and_types_are_errors() {
    let acts = Q8Acts::quantize(&[0.5; 64], 32).unwrap();
    let row = vec![0u8; 20];
    let mut out = vec![0.0; 2];
    assert!(acts.dot_rows(DType::Q4_1, &row, 0, 2, &mut out).is_ok());
    assert!(
        acts.dot_rows(DType::Q4_1, &row[..19], 0, 2, &mut out)
            .is_err()
    );
    assert!(
        acts.dot_rows(DType::Q4_1, &row, 1, 2, &mut out).is_err(),
        "past the vectors"
    );
    assert!(
        acts.dot_rows(DType::F16, &row, 0, 2, &mut out).is_err(),
        "no 8-bit kernel"
    );
    assert!(dot_reference(DType::F32, &row, acts.row(0)).is_err());
}

/// A Q6_K block at the integer sum's extreme: every value −32 and every sub-block scale
/// −128, against activations of −127, sums to −32·32·127·128 per 32 values, within 2^24 in
/// magnitude; every path gives the reference's bits, and the reference the exact dot.
#[test]
fn q6_k_at_its_largest_integer_sums_is_exact() {
    let mut block = [0u8; 210];
    block[Q6_K_SCALES_OFFSET..Q6_K_D_OFFSET].fill(0x80); // −128
    let d = half::f16::from_f32(0.5);
    block[Q6_K_D_OFFSET..].copy_from_slice(&d.to_bits().to_le_bytes());
    // Value −32·0.5·(−128) = 2048 everywhere; activations −1 quantize to −127 with d 1/127.
    let xs = vec![-1.0f32; QK_K];
    let acts = Q8Acts::quantize(&xs, QK_K).unwrap();
    let x = acts.row(0);
    assert!(x.qs.iter().all(|&q| q == -127));
    let exact = 2048.0 * f64::from(x.d[0]) * -127.0 * QK_K as f64;
    let reference = dot_reference_in::<f64>(DType::Q6K, &block, x).unwrap();
    assert_eq!(reference, exact);
    let mut out = vec![0.0f64; 1];
    acts.dot_rows(DType::Q6K, &block, 0, 1, &mut out).unwrap();
    assert_eq!(out[0].to_bits(), reference.to_bits());
}
