//! Batch invariance of `matmul` on the path this CPU picks (AVX2 where present).

use tessera_kernels::cpu::Features;

mod common;

#[test]
fn batched_matmul_is_bitwise_the_single_vector_product() {
    eprintln!("path: {}", Features::get().describe());
    common::check_batch_invariance(0xba7c, 12);
}

#[test]
fn batched_fast_matmul_is_bitwise_the_single_vector_product_and_the_reference() {
    eprintln!("path: {}", Features::get().describe());
    common::check_fast_batch_invariance(0xfa57, 12);
}
