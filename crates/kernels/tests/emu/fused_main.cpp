// Runs the fused decode layer's elementwise kernels under the CPU emulation of cuda_emu.h,
// on inputs that `crates/kernels/tests/emulated.rs` writes (`emulated/fused.rs`), and
// writes their outputs back: `rmsnorm_residual_bf16` (rmsnorm.cu; a block of 256 threads
// per token, as `Ops::rmsnorm_residual_bf16` launches it) or `silu_mul_bf16`
// (activation.cu; blocks of 256 threads striding over the values, at most 4 blocks, so
// that the stride loop turns).
//
//   fused_main INPUT OUTPUT
//
// INPUT (little-endian): u32 kernel (0: rmsnorm, 1: silu_mul), u32 width (hidden or
// inter), u32 tokens, then
// - rmsnorm: u32 has_x, f32 eps, the residual (f32, tokens × hidden), x (f32, the same,
//   where has_x) and the weight (f32, hidden); OUTPUT: out16 (u16 bits), out32 (f32) and
//   the residual after the launch (f32);
// - silu_mul: the gate|up rows (f32, tokens × 2 inter); OUTPUT: out16 and out32.

#include "cuda_emu.h"
#include "prelude.cuh"
#include "rmsnorm.cu"
#include "activation.cu"

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: fused_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const std::vector<unsigned int> h = in.take<unsigned int>(3);
    const unsigned int kernel = h[0], width = h[1], tokens = h[2];
    const size_t n = (size_t)width * tokens;
    std::vector<bf16_t> out16(n, 0xffff);
    std::vector<float> out32(n, NAN);
    emu_io::Writer o(argv[2]);
    if (kernel == 0) {
        const bool has_x = in.take<unsigned int>(1)[0] != 0;
        const float eps = in.take<float>(1)[0];
        auto residual = in.take<float>(n);
        const auto x = in.take<float>(has_x ? n : 0);
        const auto weight = in.take<float>(width);
        emu::launch(dim3(tokens), dim3(256), [&] {
            rmsnorm_residual_bf16(out16.data(), out32.data(), residual.data(),
                                  has_x ? x.data() : nullptr, weight.data(), width, eps);
        });
        o.put(out16);
        o.put(out32);
        o.put(residual);
    } else if (kernel == 1) {
        const auto gate_up = in.take<float>(2 * n);
        const unsigned int blocks = (unsigned int)((n + 255) / 256);
        emu::launch(dim3(blocks < 4 ? blocks : 4), dim3(256), [&] {
            silu_mul_bf16(out16.data(), out32.data(), gate_up.data(), width, tokens);
        });
        o.put(out16);
        o.put(out32);
    } else {
        fprintf(stderr, "fused_main: no kernel %u\n", kernel);
        return 2;
    }
    return o.close();
}
