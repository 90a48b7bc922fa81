//! Errors of the kernel layer: shape and type mismatches found before any compute runs.

use crate::DType;

/// A kernel refused its inputs.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("a row of {cols} {dtype} values is not a whole number of {block_elems}-value blocks")]
    PartialBlock {
        dtype: DType,
        cols: usize,
        block_elems: usize,
    },
    #[error("{what}: expected {expected} bytes, got {actual}")]
    ByteLength {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error(
        "{dtype} weights of {cols} columns in {precision:?} have no 8-bit-activation kernel \
         (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS in whole \
         32-value blocks, in `fast`)"
    )]
    NoIntegerKernel {
        dtype: DType,
        cols: usize,
        precision: crate::matmul::Precision,
    },
    #[error("{what}: expected {expected} values, got {actual}")]
    Length {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
}
