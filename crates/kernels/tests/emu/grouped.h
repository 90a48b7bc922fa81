// What the drivers of attention_grouped.cu share (included after it and io.h): the
// kernel's entry for a shape, and its launch with the reduce where it splits.

#pragma once

using GroupedKernel = void (*)(GROUPED_PARAMS);

// The entry for a head_dim and a GQA group, as the host's `grouped_entry`
// (ops/attention.rs) picks it: the group rounded up to 1, 2, 4 or 8; nullptr for a
// head_dim other than 16, 32, 64 or 128, or a group over 8.
inline GroupedKernel grouped_entry(unsigned int head_dim, unsigned int group) {
    static const GroupedKernel entries[4][4] = {
        {attention_grouped_d16_g1, attention_grouped_d16_g2, attention_grouped_d16_g4,
         attention_grouped_d16_g8},
        {attention_grouped_d32_g1, attention_grouped_d32_g2, attention_grouped_d32_g4,
         attention_grouped_d32_g8},
        {attention_grouped_d64_g1, attention_grouped_d64_g2, attention_grouped_d64_g4,
         attention_grouped_d64_g8},
        {attention_grouped_d128_g1, attention_grouped_d128_g2, attention_grouped_d128_g4,
         attention_grouped_d128_g8},
    };
    const int row = head_dim == 16 ? 0 : head_dim == 32 ? 1 : head_dim == 64 ? 2
                  : head_dim == 128 ? 3 : -1;
    const int col = group <= 1 ? 0 : group <= 2 ? 1 : group <= 4 ? 2 : group <= 8 ? 3 : -1;
    return row < 0 || col < 0 ? nullptr : entries[row][col];
}

// The outputs of a launch over `b` split `partitions` ways, and its partitions' scratch.
struct GroupedRun {
    std::vector<float> out;
    std::vector<bf16_t> out16;
    std::vector<float> part_out, part_max, part_sum;

    GroupedRun(const emu_io::PagedBatch& b, unsigned int partitions) {
        const size_t values = (size_t)b.queries * b.q_heads * b.d;
        const size_t parts = (size_t)b.queries * b.q_heads * partitions;
        // NaN and all-ones bf16: a value the kernels do not write shows.
        out.assign(values, NAN);
        out16.assign(values, 0xffff);
        part_out.assign(parts * b.d, NAN);
        part_max.assign(parts, NAN);
        part_sum.assign(parts, NAN);
    }

    // Launches `kernel(this run's outputs and scratch)` over the grid of `b` and
    // `partitions`, then the reduce where it split.
    template <class Launch>
    void launch(const emu_io::PagedBatch& b, unsigned int partitions, Launch kernel) {
        emu::launch(dim3(b.kv_heads, b.queries, partitions), dim3(GROUPED_WARPS * 32), [&] {
            kernel(out.data(), out16.data(), part_out.data(), part_max.data(),
                   part_sum.data());
        });
        if (partitions > 1) {
            emu::launch(dim3(b.q_heads, b.queries), dim3(GROUPED_WARPS * 32), [&] {
                attention_grouped_reduce(out.data(), out16.data(), part_out.data(),
                                         part_max.data(), part_sum.data(),
                                         b.contexts.data(), b.q_heads, b.d, partitions,
                                         b.window);
            });
        }
    }
};
