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
    let ws: [MatRef<'_>; 3] = std::array::from_fn(|i| {
        let (dtype, rows) = shapes[i];
        MatRef::new(dtype, rows, cols, &data[i]).unwrap()
    });
    for precision in [Precision::Exact, Precision::Fast] {
        for n in [1, 3] {
            let xs: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let input = Input::new(&xs, precision);
            let mut outs = ws.map(|w| vec![f32::NAN; n * w.rows()]);
            matmul_input_many(&ws, &input, outs.each_mut().map(|o| &mut o[..])).unwrap();
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
            let mut short = ws.map(|w| vec![0.0; n * w.rows() - 1]);
            let short = short.each_mut().map(|o| &mut o[..]);
            assert!(matmul_input_many(&ws, &input, short).is_err());
        }
    }
}

/// An input made vector by vector (`Input::make`: a norm or gated activation fused with the
/// 8-bit quantization) gives the bits of the same vectors made first and then quantized
/// (`Input::new`), in both precisions, for inputs made on one thread and across the pool,
/// with rows with and without whole octets of blocks.
#[test]
fn an_input_made_vector_by_vector_gives_the_bits_of_one_made_first() {
    use rand::{Rng, SeedableRng};
    use tessera_kernels::DType;
    use tessera_kernels::matmul::{Input, MatRef, Precision, matmul_input};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x3a8);
    for (cols, n) in [(96, 1), (96, 200), (576, 3), (576, 40)] {
        let data = common::random_rows(&mut rng, DType::Q4_1, 40, cols);
        let w = MatRef::new(DType::Q4_1, 40, cols, &data).unwrap();
        let source: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        // Each vector made from the source as a norm would: scaled by its own factor.
        let row = |t: usize, out: &mut [f32]| {
            for (o, s) in out.iter_mut().zip(&source[t * cols..][..cols]) {
                *o = s * (t as f32 + 0.5);
            }
        };
        for precision in [Precision::Exact, Precision::Fast] {
            // Made first: the buffers it reuses hold another input's blocks.
            let mut made = vec![f32::NAN; n * cols];
            let input = Input::make(&mut made, cols, precision, row).unwrap();
            let mut got = vec![f32::NAN; n * 40];
            matmul_input(&w, &input, &mut got).unwrap();
            drop(input);
            let mut first = vec![0.0; n * cols];
            first
                .chunks_mut(cols)
                .enumerate()
                .for_each(|(t, x)| row(t, x));
            let mut want = vec![f32::NAN; n * 40];
            matmul_input(&w, &Input::new(&first, precision), &mut want).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&made),
                bits(&first),
                "{precision:?} cols {cols} n {n}: vectors"
            );
            assert_eq!(
                bits(&got),
                bits(&want),
                "{precision:?} cols {cols} n {n}: matmul"
            );
        }
    }
    let mut odd = vec![0.0; 100];
    assert!(Input::make(&mut odd, 96, Precision::Fast, |_, _| {}).is_err());
}
