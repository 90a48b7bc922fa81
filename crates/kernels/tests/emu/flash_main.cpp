// Runs the prefill attention kernel (crates/kernels/cuda/attention_flash.cu) under the CPU
// emulation of cuda_emu.h, on inputs that `crates/kernels/tests/emulated.rs` writes, and
// writes its outputs back for that test to compare with the kernel's CPU twin.
//
//   flash_main INPUT OUTPUT
//
// INPUT (little-endian): an `emu_io::PagedBatch` (io.h) whose last header word is the
// count of tiles, then the tiles (u32 pairs). OUTPUT: the output (f32) and its bf16 copy
// (u16 bits), each of q's length.

#include "cuda_emu.h"
#include "prelude.cuh"
#include "attention_flash.cu"

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: flash_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const emu_io::PagedBatch b(in);
    const unsigned int d = b.d, tiles = b.last;
    const auto tile_pairs = in.take<unsigned int>(2 * (size_t)tiles);

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
    std::vector<float> out(b.q.size(), NAN);
    std::vector<bf16_t> out16(b.q.size(), 0xffff);
    emu::launch(dim3(b.q_heads, tiles), dim3(FLASH_WARPS * 32), [&] {
        kernel(out.data(), out16.data(), b.q.data(), b.k.data(), b.v.data(), b.tables.data(),
               b.query_seq.data(), b.contexts.data(), tile_pairs.data(), b.max_blocks,
               b.block_size, b.q_heads, b.kv_heads, b.window, b.scale_log2);
    });

    emu_io::Writer o(argv[2]);
    o.put(out);
    o.put(out16);
    return o.close();
}
