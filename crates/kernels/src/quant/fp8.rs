//! FP8 weights: float8 e4m3fn, as HuggingFace checkpoints store them (`F8_E4M3` in
//! safetensors), held in Tessera's block layout [`DType::F8E4M3`](crate::DType::F8E4M3):
//! blocks of 32 values, each an f32 scale `s` (the tensor's or the row's, repeated) and 32
//! e4m3fn bytes; `x = s · e4m3(q)`, rounded to f32 as transformers' `q.float() * s` is.
//!
//! e4m3fn: a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits; exponent 0 is
//! subnormal (`m/8 · 2^-6`); `S.1111.111` is NaN and there are no infinities, so the
//! largest finite value is ±448. Every value is exact in f32, and in f16 scaled by 2^-8
//! (what the AVX2 kernel widens through).

use crate::error::KernelError;

/// Values in one block.
pub const F8_E4M3_BLOCK_VALUES: usize = 32;
/// Bytes of one block: the f32 scale, then 32 codes.
pub const F8_E4M3_BLOCK_BYTES: usize = 4 + F8_E4M3_BLOCK_VALUES;

/// The value of every e4m3fn code.
pub const E4M3: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut q = 0;
    while q < 256 {
        table[q] = e4m3_value(q as u8);
        q += 1;
    }
    table
}

/// The value of e4m3fn code `q`, by its definition.
const fn e4m3_value(q: u8) -> f32 {
    let exponent = (q >> 3) & 0x0f;
    let mantissa = (q & 0x07) as f32;
    let magnitude = if exponent == 0x0f && q & 0x07 == 0x07 {
        f32::NAN
    } else if exponent == 0 {
        mantissa / 8.0 / 64.0
    } else {
        // 2^(exponent - 7), built from its f32 bits.
        (1.0 + mantissa / 8.0) * f32::from_bits((exponent as u32 + 120) << 23)
    };
    if q & 0x80 != 0 { -magnitude } else { magnitude }
}

/// The scale of one block.
#[inline]
pub fn block_scale(block: &[u8; F8_E4M3_BLOCK_BYTES]) -> f32 {
    f32::from_le_bytes([block[0], block[1], block[2], block[3]])
}

/// One block: `s · e4m3(q)` for each of its 32 codes.
#[inline]
pub fn dequantize_block_f8_e4m3(
    block: &[u8; F8_E4M3_BLOCK_BYTES],
    out: &mut [f32; F8_E4M3_BLOCK_VALUES],
) {
    let s = block_scale(block);
    for (o, &q) in out.iter_mut().zip(&block[4..]) {
        *o = s * E4M3[q as usize];
    }
}

/// Packs one row of e4m3fn `codes` and its `scale` into blocks (`out`: `codes.len() / 32`
/// blocks of [`F8_E4M3_BLOCK_BYTES`]).
pub fn pack_row(codes: &[u8], scale: f32, out: &mut [u8]) -> Result<(), KernelError> {
    if !codes.len().is_multiple_of(F8_E4M3_BLOCK_VALUES) {
        return Err(KernelError::PartialBlock {
            dtype: crate::DType::F8E4M3,
            cols: codes.len(),
            block_elems: F8_E4M3_BLOCK_VALUES,
        });
    }
    let blocks = codes.len() / F8_E4M3_BLOCK_VALUES;
    if out.len() != blocks * F8_E4M3_BLOCK_BYTES {
        return Err(KernelError::ByteLength {
            what: "FP8 packed row",
            expected: blocks * F8_E4M3_BLOCK_BYTES,
            actual: out.len(),
        });
    }
    let chunks = codes.chunks_exact(F8_E4M3_BLOCK_VALUES);
    for (block, chunk) in out.chunks_exact_mut(F8_E4M3_BLOCK_BYTES).zip(chunks) {
        block[..4].copy_from_slice(&scale.to_le_bytes());
        block[4..].copy_from_slice(chunk);
    }
    Ok(())
}

/// Makes a block of random bytes a valid one for tests and benchmarks: scale `scale`, and
/// each NaN code replaced by zero.
pub fn make_finite(block: &mut [u8], scale: f32) {
    block[..4].copy_from_slice(&scale.to_le_bytes());
    for q in &mut block[4..] {
        if *q & 0x7f == 0x7f {
            *q = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_have_their_defined_values() {
        let cases: [(u8, f32); 9] = [
            (0x00, 0.0),
            (0x80, -0.0),
            (0x01, 1.0 / 512.0), // the smallest subnormal, 2^-9
            (0x07, 7.0 / 512.0), // the largest subnormal
            (0x08, 1.0 / 64.0),  // the smallest normal, 2^-6
            (0x38, 1.0),
            (0x3c, 1.5),
            (0x7e, 448.0),
            (0xfe, -448.0),
        ];
        for (q, want) in cases {
            assert_eq!(E4M3[q as usize].to_bits(), want.to_bits(), "code {q:#04x}");
        }
        assert!(E4M3[0x7f].is_nan() && E4M3[0xff].is_nan());
        assert_eq!(E4M3.iter().filter(|v| v.is_nan()).count(), 2);
    }

    #[test]
    fn a_packed_row_dequantizes_to_scale_times_value() {
        let codes: Vec<u8> = (0..64).map(|i| (i * 3) as u8).collect();
        let mut row = vec![0u8; 2 * F8_E4M3_BLOCK_BYTES];
        pack_row(&codes, 0.125, &mut row).unwrap();
        let mut out = [0.0f32; 32];
        let (blocks, _) = row.as_chunks::<F8_E4M3_BLOCK_BYTES>();
        dequantize_block_f8_e4m3(&blocks[1], &mut out);
        for (o, &q) in out.iter().zip(&codes[32..]) {
            assert_eq!(*o, 0.125 * E4M3[q as usize]);
        }
        assert!(pack_row(&codes[..40], 1.0, &mut row).is_err());
        assert!(pack_row(&codes, 1.0, &mut row[..36]).is_err());
    }
}
