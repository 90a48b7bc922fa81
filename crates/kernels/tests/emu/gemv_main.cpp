// Runs the bf16 GEMV of small decode batches (crates/kernels/cuda/gemv.cu) under the CPU
// emulation of cuda_emu.h, on inputs that `crates/kernels/tests/emulated.rs` writes, and
// writes its outputs back for that test.
//
//   gemv_main INPUT OUTPUT
//
// INPUT (little-endian): u32 rows, cols, tokens (1 to 8) and offset, then W (bf16 bits,
// rows × cols) and offset + tokens × cols bf16 activations, the kernel reading them from
// `offset` on (an offset not a multiple of 8 takes the 2-byte path). OUTPUT: ys (f32,
// tokens × rows).

#include "cuda_emu.h"
#include "prelude.cuh"
#include "gemv.cu"

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: gemv_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const std::vector<unsigned int> h = in.take<unsigned int>(4);
    const unsigned int rows = h[0], cols = h[1], tokens = h[2], offset = h[3];
    const auto w = in.take<bf16_t>((size_t)rows * cols);
    const auto xs = in.take<bf16_t>(offset + (size_t)tokens * cols);
    using Kernel = void (*)(GEMV_PARAMS);
    const Kernel entries[8] = {gemv_bf16_t1, gemv_bf16_t2, gemv_bf16_t3, gemv_bf16_t4,
                               gemv_bf16_t5, gemv_bf16_t6, gemv_bf16_t7, gemv_bf16_t8};
    if (tokens == 0 || tokens > 8) {
        fprintf(stderr, "gemv_main: %u tokens (1 to 8)\n", tokens);
        return 2;
    }
    std::vector<float> ys((size_t)tokens * rows, NAN);
    const unsigned int blocks = rows == 0 ? 1 : (rows + GEMV_ROWS - 1) / GEMV_ROWS;
    emu::launch(dim3(blocks), dim3(GEMV_WARPS * 32), [&] {
        entries[tokens - 1](ys.data(), w.data(), xs.data() + offset, rows, cols);
    });
    emu_io::Writer o(argv[2]);
    o.put(ys);
    return o.close();
}
