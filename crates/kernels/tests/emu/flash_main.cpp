// Runs the prefill attention kernel (crates/kernels/cuda/attention_flash.cu) under the CPU
// emulation of cuda_emu.h, on inputs that `crates/kernels/tests/emulated.rs` writes, and
// writes its outputs back for that test to compare with the kernel's CPU twin.
//
//   flash_main INPUT OUTPUT
//
// INPUT (little-endian): 10 u32 — head_dim, q_heads, kv_heads, block_size, max_blocks,
// window, queries, sequences, cache blocks, tiles — and the f32 scale_log2; then the block
// tables (u32, sequences × max_blocks), query_seq and contexts (u32, queries each), the
// tiles (u32 pairs), K and V (bf16 bits, cache blocks × block_size × kv_heads × head_dim
// each), and q (f32, queries × q_heads × head_dim). OUTPUT: the output (f32) and its bf16
// copy (u16 bits), each of q's length.

#include "cuda_emu.h"
#include "prelude.cuh"
#include "attention_flash.cu"

namespace {

template <class T>
std::vector<T> take(FILE* f, size_t n) {
    std::vector<T> v(n);
    if (n != 0 && fread(v.data(), sizeof(T), n, f) != n) {
        fprintf(stderr, "flash_main: the input ends early\n");
        exit(2);
    }
    return v;
}

} // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: flash_main INPUT OUTPUT\n");
        return 2;
    }
    FILE* in = fopen(argv[1], "rb");
    if (in == nullptr) {
        perror(argv[1]);
        return 2;
    }
    const std::vector<unsigned int> h = take<unsigned int>(in, 10);
    const unsigned int d = h[0], q_heads = h[1], kv_heads = h[2], block_size = h[3];
    const unsigned int max_blocks = h[4], window = h[5], queries = h[6], seqs = h[7];
    const unsigned int blocks = h[8], tiles = h[9];
    const float scale_log2 = take<float>(in, 1)[0];
    const auto tables = take<unsigned int>(in, (size_t)seqs * max_blocks);
    const auto query_seq = take<unsigned int>(in, queries);
    const auto contexts = take<unsigned int>(in, queries);
    const auto tile_pairs = take<unsigned int>(in, 2 * (size_t)tiles);
    const size_t pool = (size_t)blocks * block_size * kv_heads * d;
    const auto k = take<bf16_t>(in, pool);
    const auto v = take<bf16_t>(in, pool);
    const auto q = take<float>(in, (size_t)queries * q_heads * d);
    fclose(in);

    using Kernel = void (*)(FLASH_PARAMS);
    Kernel kernel = nullptr;
    switch (d) {
    case 16: kernel = attention_flash_d16; break;
    case 32: kernel = attention_flash_d32; break;
    case 64: kernel = attention_flash_d64; break;
    case 128: kernel = attention_flash_d128; break;
    default: fprintf(stderr, "flash_main: no kernel for head_dim %u\n", d); return 2;
    }
    // NaN and all-ones bf16: a value the kernel does not write shows.
    std::vector<float> out(q.size(), NAN);
    std::vector<bf16_t> out16(q.size(), 0xffff);
    emu::launch(dim3(q_heads, tiles), dim3(FLASH_WARPS * 32), [&] {
        kernel(out.data(), out16.data(), q.data(), k.data(), v.data(), tables.data(),
               query_seq.data(), contexts.data(), tile_pairs.data(), max_blocks, block_size,
               q_heads, kv_heads, window, scale_log2);
    });

    FILE* o = fopen(argv[2], "wb");
    if (o == nullptr) {
        perror(argv[2]);
        return 2;
    }
    fwrite(out.data(), sizeof(float), out.size(), o);
    fwrite(out16.data(), sizeof(bf16_t), out16.size(), o);
    return fclose(o) == 0 ? 0 : 2;
}
