//! The two types a device table holds its values in: bf16 (as its bits, `u16`) on the
//! default path, f32 on the exact one (the topology's `dtype = "f32"`). The kernels that
//! read or write a table of either (the embedding gather, the KV write, the legacy paged
//! attention) are one template in CUDA C with an entry per type; their launches in
//! [`super::Ops`] are generic over [`Held`] and pick the entry by it.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// A value type of the device's tables: `u16` (bf16 bits) or `f32`.
pub trait Held: DeviceRepr + ValidAsZeroBits + Unpin + Copy + Default + 'static {
    /// Whether it is f32 (else bf16).
    const F32: bool;

    /// The entry of the kernel written for this type: `bf16` or `f32`.
    fn entry(bf16: &'static str, f32: &'static str) -> &'static str {
        if Self::F32 { f32 } else { bf16 }
    }
}

impl Held for u16 {
    const F32: bool = false;
}

impl Held for f32 {
    const F32: bool = true;
}
