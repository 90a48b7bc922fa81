// Runs the dequantizing matvecs of decode (crates/kernels/cuda/dequant_matmul.cu:
// `matvec_q8_0`, `matvec_q5_0`, `matvec_q4_k`, `matvec_q5_k`, `matvec_q6_k`,
// `matvec_f8_e4m3`) under the CPU emulation of cuda_emu.h,
// launched as `Ops::matvec_quantized` launches them (a warp per (row, token), 4 warps a
// block), on inputs that `crates/kernels/tests/emulated.rs` writes; writes the output back
// for that test.
//
//   matvec_main INPUT OUTPUT
//
// INPUT (little-endian): u32 kernel (0: Q8_0, 1: Q4_K, 2: FP8, 3: Q5_0, 4: Q5_K, 5: Q6_K), rows, cols, tokens and
// row_bytes, then W (rows × row_bytes bytes) and x (f32, tokens × cols). OUTPUT: out (f32,
// tokens × rows).

#include "cuda_emu.h"
#include "prelude.cuh"
#include "dequant_matmul.cu"

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: matvec_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const std::vector<unsigned int> h = in.take<unsigned int>(5);
    const unsigned int kernel = h[0], rows = h[1], cols = h[2], tokens = h[3], row_bytes = h[4];
    using Matvec = void (*)(float*, const unsigned char*, const float*, unsigned int,
                            unsigned int);
    const Matvec kernels[6] = {matvec_q8_0, matvec_q4_k, matvec_f8_e4m3,
                               matvec_q5_0, matvec_q5_k, matvec_q6_k};
    if (kernel > 5) {
        fprintf(stderr, "matvec_main: no kernel %u\n", kernel);
        return 2;
    }
    const auto w = in.take<unsigned char>((size_t)rows * row_bytes);
    const auto x = in.take<float>((size_t)tokens * cols);
    std::vector<float> out((size_t)tokens * rows, NAN);
    const unsigned int warps = 4;
    emu::launch(dim3((rows + warps - 1) / warps, tokens), dim3(32 * warps), [&] {
        kernels[kernel](out.data(), w.data(), x.data(), rows, cols);
    });
    emu_io::Writer o(argv[2]);
    o.put(out);
    return o.close();
}
