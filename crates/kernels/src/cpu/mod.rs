//! CPU kernels: run-time feature detection and the SIMD row-dot products that every matrix
//! kernel is built from: one row with one vector ([`RowDot`]) or with several at once
//! ([`BatchDot`], bit for bit the same per vector).
//!
//! Also the sampling rule ([`sample_threshold`]): the host sampler's, and the CPU twin of
//! the CUDA sampling kernel, to the bit.
//!
//! [`Features::get`] is read once per process. Each SIMD path has the scalar reference in
//! [`crate::quant::dot_row`] as its twin; tests compare the two on random data.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod dot;
pub mod int8;
mod threshold_sampling;

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::dot_f32 as dot_f32_avx2;
pub use dot::{BatchDot, RowDot, dot_f32};
pub use threshold_sampling::{
    RowDraw, SampleScratch, ThresholdParams, sample_threshold, sample_threshold_in,
};

use std::sync::OnceLock;

/// The CPU features the kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// AVX2 + FMA + F16C (x86-64-v3).
    pub avx2: bool,
    /// AVX-512 VNNI with VL, besides AVX2: 8-bit dot products on 256-bit registers
    /// ([`int8`]).
    pub vnni: bool,
}

impl Features {
    /// The features of this CPU, detected once. `TESSERA_FORCE_SCALAR` is not read here
    /// (libraries read no environment); binaries call [`Features::force_scalar`] instead.
    pub fn get() -> Features {
        *FEATURES.get_or_init(Features::detect)
    }

    /// Disables every SIMD path for this process (used by tests and by `--scalar` flags).
    /// Returns false if the features were already read.
    pub fn force_scalar() -> bool {
        FEATURES
            .set(Features {
                avx2: false,
                vnni: false,
            })
            .is_ok()
    }

    fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            Features {
                avx2,
                vnni: avx2
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vl"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Features {
                avx2: false,
                vnni: false,
            }
        }
    }

    /// A short name for logs and benchmark reports.
    pub fn describe(self) -> &'static str {
        match (self.avx2, self.vnni) {
            (true, true) => "avx2+fma+f16c, avx512-vnni",
            (true, false) => "avx2+fma+f16c",
            _ => "scalar",
        }
    }
}

static FEATURES: OnceLock<Features> = OnceLock::new();
