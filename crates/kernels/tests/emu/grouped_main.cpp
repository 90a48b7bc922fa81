// Runs the grouped decode attention kernel (crates/kernels/cuda/attention_grouped.cu; q
// rotated already, no append) under the CPU emulation of cuda_emu.h, split along the
// context into the partitions asked for and merged by its reduce kernel, on inputs that
// `crates/kernels/tests/emulated.rs` writes; writes its outputs back for that test.
//
//   grouped_main INPUT OUTPUT
//
// INPUT (little-endian): an `emu_io::PagedBatch` (io.h) whose last header word is the
// count of partitions. OUTPUT: the output (f32) and its bf16 copy (u16 bits), each of q's
// length.

#include "cuda_emu.h"
#include "prelude.cuh"
#include "attention_grouped.cu"

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: grouped_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const emu_io::PagedBatch b(in);
    const unsigned int d = b.d, q_heads = b.q_heads, queries = b.queries, partitions = b.last;

    // The entry for (head_dim, group rounded up to 1, 2, 4 or 8), as `grouped_entry` picks.
    using Kernel = void (*)(GROUPED_PARAMS);
    const Kernel entries[4][4] = {
        {attention_grouped_d16_g1, attention_grouped_d16_g2, attention_grouped_d16_g4,
         attention_grouped_d16_g8},
        {attention_grouped_d32_g1, attention_grouped_d32_g2, attention_grouped_d32_g4,
         attention_grouped_d32_g8},
        {attention_grouped_d64_g1, attention_grouped_d64_g2, attention_grouped_d64_g4,
         attention_grouped_d64_g8},
        {attention_grouped_d128_g1, attention_grouped_d128_g2, attention_grouped_d128_g4,
         attention_grouped_d128_g8},
    };
    const int row = d == 16 ? 0 : d == 32 ? 1 : d == 64 ? 2 : d == 128 ? 3 : -1;
    const unsigned int group = q_heads / b.kv_heads;
    const int col = group <= 1 ? 0 : group <= 2 ? 1 : group <= 4 ? 2 : group <= 8 ? 3 : -1;
    if (row < 0 || col < 0 || partitions == 0 || partitions > GROUPED_MAX_PARTITIONS) {
        fprintf(stderr, "grouped_main: no kernel for head_dim %u, group %u, %u partitions\n",
                d, group, partitions);
        return 2;
    }
    std::vector<float> out(b.q.size(), NAN);
    std::vector<bf16_t> out16(b.q.size(), 0xffff);
    const size_t parts = (size_t)queries * q_heads * partitions;
    std::vector<float> part_out(parts * d, NAN), part_max(parts, NAN), part_sum(parts, NAN);
    const Kernel kernel = entries[row][col];
    emu::launch(dim3(b.kv_heads, queries, partitions), dim3(GROUPED_WARPS * 32), [&] {
        kernel(out.data(), out16.data(), part_out.data(), part_max.data(), part_sum.data(),
               b.q.data(), b.k.data(), b.v.data(), b.tables.data(), b.query_seq.data(),
               b.contexts.data(), b.max_blocks, b.block_size, q_heads, b.kv_heads,
               partitions, b.window, b.scale_log2, nullptr, nullptr, nullptr, nullptr,
               nullptr, 0u, nullptr, nullptr);
    });
    if (partitions > 1) {
        emu::launch(dim3(q_heads, queries), dim3(GROUPED_WARPS * 32), [&] {
            attention_grouped_reduce(out.data(), out16.data(), part_out.data(),
                                     part_max.data(), part_sum.data(), b.contexts.data(),
                                     q_heads, d, partitions, b.window);
        });
    }
    emu_io::Writer o(argv[2]);
    o.put(out);
    o.put(out16);
    return o.close();
}
