//! Float storage types F32, F16 and BF16 seen as "blocks" of one value, so that the row
//! functions in [`super`] treat every `DType` the same way.
//!
//! All three are stored little-endian, as GGUF and safetensors store them. Widening to f32 is
//! exact for every value, including subnormals and infinities.

use half::{bf16, f16};

/// Bytes of one F32 value.
pub const F32_BYTES: usize = 4;
/// Bytes of one F16 value.
pub const F16_BYTES: usize = 2;
/// Bytes of one BF16 value.
pub const BF16_BYTES: usize = 2;

/// The f16 stored little-endian in `bytes`, widened to f32.
#[inline]
pub fn f16_le_to_f32(bytes: [u8; 2]) -> f32 {
    f16::from_le_bytes(bytes).to_f32()
}

/// The bf16 stored little-endian in `bytes`, widened to f32 (the bf16 bits are the top half of
/// the f32 bits).
#[inline]
pub fn bf16_le_to_f32(bytes: [u8; 2]) -> f32 {
    bf16::from_le_bytes(bytes).to_f32()
}

/// One F32 value.
#[inline]
pub fn dequantize_block_f32(block: &[u8; F32_BYTES], out: &mut [f32; 1]) {
    out[0] = f32::from_le_bytes(*block);
}

/// One F16 value.
#[inline]
pub fn dequantize_block_f16(block: &[u8; F16_BYTES], out: &mut [f32; 1]) {
    out[0] = f16_le_to_f32(*block);
}

/// One BF16 value.
#[inline]
pub fn dequantize_block_bf16(block: &[u8; BF16_BYTES], out: &mut [f32; 1]) {
    out[0] = bf16_le_to_f32(*block);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_values_widen_exactly() {
        let cases: [(u16, f32); 6] = [
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x0001, 5.960_464_5e-8), // smallest subnormal, 2^-24
            (0x7bff, 65504.0),
            (0x7c00, f32::INFINITY),
            (0x8000, -0.0),
        ];
        for (bits, want) in cases {
            let got = f16_le_to_f32(bits.to_le_bytes());
            assert_eq!(got.to_bits(), want.to_bits(), "f16 bits {bits:#06x}");
        }
    }

    #[test]
    fn bf16_is_the_top_half_of_f32() {
        for bits in [0x3f80u16, 0xc049, 0x0001, 0x7f80, 0xff7f] {
            let mut out = [0.0];
            dequantize_block_bf16(&bits.to_le_bytes(), &mut out);
            assert_eq!(
                out[0].to_bits(),
                u32::from(bits) << 16,
                "bf16 bits {bits:#06x}"
            );
        }
    }

    #[test]
    fn f32_is_little_endian() {
        let mut out = [0.0];
        dequantize_block_f32(&[0x00, 0x00, 0x80, 0x3f], &mut out);
        assert_eq!(out[0], 1.0);
    }
}
