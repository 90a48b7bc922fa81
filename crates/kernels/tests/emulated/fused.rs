//! The fused decode layer's elementwise kernels under the CPU emulation, against their
//! twins in `fused`, as `fused_case` holds them on the GPU: `rmsnorm_residual_bf16` (the
//! residual add within 1e-6, the f32 norm within 1e-5, each bf16 the twin's or a
//! neighbour) and `silu_mul_bf16` (the same for its outputs).

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tessera_kernels::fused;

use super::common::{close_bf16, rmsnorm_bf16_twin};
use super::{compiled, drive as run, f32s, u16s, within};

fn floats(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn put(bytes: &mut Vec<u8>, values: &[f32]) {
    values.iter().for_each(|x| bytes.extend(x.to_le_bytes()));
}

/// Hidden sizes that are multiples of 4 (2,048 and 576: the 16-byte path) and not (2,049
/// and 2,050: the scalar path), with and without the residual add, three tokens each; then
/// the activation.
#[test]
fn the_fused_norm_and_activation_emulated_are_their_twins() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compiled("fused_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(59);
    let tokens = 3;
    for hidden in [2048, 2049, 2050, 576] {
        for add in [true, false] {
            let residual = floats(&mut rng, hidden * tokens, 2.0);
            let x = floats(&mut rng, hidden * tokens, 1.0);
            let weight = floats(&mut rng, hidden, 1.5);
            let mut input = Vec::new();
            for word in [0, hidden as u32, tokens as u32, u32::from(add)] {
                input.extend(word.to_le_bytes());
            }
            put(&mut input, &[1e-5]);
            put(&mut input, &residual);
            if add {
                put(&mut input, &x);
            }
            put(&mut input, &weight);
            let bytes = run(&exe, dir.path(), &input);
            let n = hidden * tokens;
            assert_eq!(bytes.len(), n * 10, "the emulator's output");
            let (got16, got32, got_res) = (
                u16s(&bytes[..n * 2]),
                f32s(&bytes[n * 2..n * 6]),
                f32s(&bytes[n * 6..]),
            );
            let (want_res, want16, want32) =
                rmsnorm_bf16_twin(&residual, add.then_some(&x), &weight);
            let what = format!("rmsnorm bf16, hidden {hidden}, add {add}");
            within(&what, &got_res, &want_res, 1e-6);
            within(&what, &got32, &want32, 1e-5);
            close_bf16(&what, &got16, &want16);
        }
    }
    // 1,536: four values a thread; 1,537: one; 8,192 over 4 blocks: the stride loop.
    for (inter, tokens) in [(1536, 3), (1537, 5), (8192, 1)] {
        let gate_up = floats(&mut rng, 2 * inter * tokens, 6.0);
        let mut input = Vec::new();
        for word in [1, inter as u32, tokens as u32] {
            input.extend(word.to_le_bytes());
        }
        put(&mut input, &gate_up);
        let bytes = run(&exe, dir.path(), &input);
        let n = inter * tokens;
        assert_eq!(bytes.len(), n * 6, "the emulator's output");
        let (got16, got32) = (u16s(&bytes[..n * 2]), f32s(&bytes[n * 2..]));
        let mut want16 = vec![0u16; n];
        let mut want32 = Vec::new();
        for (row, out) in gate_up.chunks(2 * inter).zip(want16.chunks_mut(inter)) {
            want32.extend(fused::silu_mul_bf16(row, out));
        }
        let what = format!("silu_mul bf16, inter {inter}");
        within(&what, &got32, &want32, 1e-5);
        close_bf16(&what, &got16, &want16);
    }
}
