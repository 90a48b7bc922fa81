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

/// One input through several matrices at once (`matmul_input_many`, one parallel region
/// for one vector) gives each matrix's own `matmul_input` bits, in both precisions, for
/// one vector and for several, with types that take the 8-bit path and one that does not.
#[test]
fn several_matmuls_of_one_input_give_each_ones_bits() {
    use rand::{Rng, SeedableRng};
    use tessera_kernels::DType;
    use tessera_kernels::matmul::{Input, MatRef, Precision, matmul_input, matmul_input_many};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x3a7);
    let cols = 96;
    let shapes = [(DType::Q4_1, 70), (DType::F32, 17), (DType::Q8_0, 33)];
    let data: Vec<Vec<u8>> = (shapes.iter())
        .map(|&(dtype, rows)| common::random_rows(&mut rng, dtype, rows, cols))
        .collect();
    let ws: Vec<MatRef<'_>> = (shapes.iter().zip(&data))
        .map(|(&(dtype, rows), data)| MatRef::new(dtype, rows, cols, data).unwrap())
        .collect();
    for precision in [Precision::Exact, Precision::Fast] {
        for n in [1, 3] {
            let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let input = Input::new(&xs, precision);
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows()]).collect();
            let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            matmul_input_many(&ws, &input, &mut slices).unwrap();
            for (w, got) in ws.iter().zip(&outs) {
                let mut want = vec![f32::NAN; n * w.rows()];
                matmul_input(w, &input, &mut want).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "{:?} {precision:?} n {n}",
                    w.dtype()
                );
            }
            let mut short: Vec<&mut [f32]> = Vec::new();
            assert!(matmul_input_many(&ws, &input, &mut short).is_err());
        }
    }
}
