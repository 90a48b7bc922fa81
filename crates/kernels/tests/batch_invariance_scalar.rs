//! Batch invariance of `matmul` on the scalar path, exact and fast (its own process: the
//! path is chosen once).

use tessera_kernels::cpu::Features;

mod common;

#[test]
fn scalar_batched_matmul_is_bitwise_the_single_vector_product() {
    assert!(
        Features::force_scalar(),
        "features were read before this test"
    );
    assert!(!Features::get().avx2);
    common::check_batch_invariance(0x5ca1, 6);
    common::check_fast_batch_invariance(0x5ca2, 6);
}
