//! Dot products of one stored weight row with an activation vector, dispatched on the
//! weight's [`DType`] and the CPU's [`Features`].

use super::Features;
use crate::{DType, KernelError, quant};

/// An activation vector prepared for many row dot products: it carries the per-32-block
/// sums that the Q4_1 min term needs, computed once instead of once per row.
#[derive(Debug)]
pub struct RowDot<'a> {
    x: &'a [f32],
    block_sums: Vec<f32>,
    features: Features,
}

impl<'a> RowDot<'a> {
    /// Prepares `x` for rows of type `dtype`.
    pub fn new(x: &'a [f32], dtype: DType) -> RowDot<'a> {
        let block_sums = if dtype == DType::Q4_1 {
            x.chunks(32).map(|c| c.iter().sum()).collect()
        } else {
            Vec::new()
        };
        RowDot {
            x,
            block_sums,
            features: Features::get(),
        }
    }

    /// Σ row·x where `row` holds one row of `dtype` values, `x.len()` of them.
    pub fn dot(&self, dtype: DType, row: &[u8]) -> Result<f32, KernelError> {
        let expected = dtype.row_bytes(self.x.len())?;
        if row.len() != expected {
            return Err(KernelError::ByteLength {
                what: "weight row",
                expected,
                actual: row.len(),
            });
        }
        #[cfg(target_arch = "x86_64")]
        if self.features.avx2 {
            return Ok(self.dot_avx2(dtype, row));
        }
        quant::dot_row(dtype, row, self.x)
    }

    #[cfg(target_arch = "x86_64")]
    fn dot_avx2(&self, dtype: DType, row: &[u8]) -> f32 {
        use super::avx2;
        let x = self.x;
        // SAFETY: `features.avx2` says AVX2, FMA and F16C are present, and `dot` checked
        // that `row` holds exactly the bytes of `x.len()` values of `dtype`.
        unsafe {
            match dtype {
                DType::F32 => avx2::dot_f32(bytemuck_f32(row).as_ref(), x),
                DType::F16 => avx2::dot_f16(row, x),
                DType::BF16 => avx2::dot_bf16(row, x),
                DType::Q8_0 => avx2::dot_q8_0(row, x),
                DType::Q4_0 => avx2::dot_q4_0(row, x),
                DType::Q4_1 => avx2::dot_q4_1(row, x, &self.block_sums),
                DType::Q4K | DType::Q6K => {
                    dequantize_dot(dtype, row, x, |a, b| avx2::dot_f32(a, b))
                }
            }
        }
    }
}

/// Σ a·b with the best kernel this CPU has.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Features::get().avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { super::avx2::dot_f32(a, b) };
    }
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// Dequantizes one block at a time into a stack buffer and dots it with `dot`.
fn dequantize_dot(dtype: DType, row: &[u8], x: &[f32], dot: impl Fn(&[f32], &[f32]) -> f32) -> f32 {
    let n = dtype.block_elems();
    let mut buf = [0.0f32; 256];
    let mut total = 0.0;
    for (block, xs) in row.chunks_exact(dtype.block_bytes()).zip(x.chunks_exact(n)) {
        // Lengths match by construction (checked by `RowDot::dot`), so this cannot fail.
        if quant::dequantize_row(dtype, block, &mut buf[..n]).is_ok() {
            total += dot(&buf[..n], xs);
        }
    }
    total
}

/// Views little-endian f32 bytes as floats, copying only when the bytes are misaligned.
fn bytemuck_f32(bytes: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(floats) => std::borrow::Cow::Borrowed(floats),
        Err(_) => std::borrow::Cow::Owned(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    }
}
