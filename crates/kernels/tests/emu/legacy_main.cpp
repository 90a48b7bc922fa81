// Runs the legacy paged attention (crates/kernels/cuda/attention.cu: partitions of PART
// positions, merged by its reduce) under the CPU emulation of cuda_emu.h, over a bf16
// cache or, on the exact path, an f32 one, on inputs that
// `crates/kernels/tests/emulated.rs` writes; writes its output back for that test.
//
//   legacy_main INPUT OUTPUT
//
// INPUT (little-endian): an `emu_io::PagedBatch` (io.h) whose last header word is 0 for
// the bf16 entry (`paged_attention_partition`, reading the batch's K and V) or 1 for the
// f32 one (`paged_attention_partition_f32`, reading the f32 K and V that follow q, as
// many values each as the batch's pool). OUTPUT: the output (f32, q's length).

#include "cuda_emu.h"
#include "prelude.cuh"
#include "attention.cu"

#include <cmath>

#include "io.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: legacy_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const emu_io::PagedBatch b(in);
    if (b.last > 1) {
        fprintf(stderr, "legacy_main: cache type %u is neither 0 (bf16) nor 1 (f32)\n", b.last);
        return 2;
    }
    const size_t pool = (size_t)b.blocks * b.block_size * b.kv_heads * b.d;
    const std::vector<float> k32 = in.take<float>(b.last == 1 ? pool : 0);
    const std::vector<float> v32 = in.take<float>(b.last == 1 ? pool : 0);

    // As the host launches it (ops/paged.rs): a partition per PART positions of the
    // longest context, 128 threads, the scale 1/√head_dim.
    unsigned int longest = 1;
    for (unsigned int c : b.contexts) {
        longest = c > longest ? c : longest;
    }
    const unsigned int partitions = (longest + PART - 1) / PART;
    const float scale = 1.0f / sqrtf((float)b.d);
    const size_t values = (size_t)b.queries * b.q_heads * b.d;
    const size_t parts = (size_t)b.queries * b.q_heads * partitions;
    // NaN: a value the kernels do not write shows.
    std::vector<float> out(values, NAN), part_out(parts * b.d, NAN), part_max(parts, NAN),
        part_sum(parts, NAN);
    emu::launch(dim3(b.q_heads, b.queries, partitions), dim3(128), [&] {
        if (b.last == 1) {
            paged_attention_partition_f32(
                part_out.data(), part_max.data(), part_sum.data(), b.q.data(), k32.data(),
                v32.data(), b.tables.data(), b.query_seq.data(), b.contexts.data(),
                b.max_blocks, b.block_size, b.q_heads, b.kv_heads, b.d, partitions, b.window,
                scale);
        } else {
            paged_attention_partition(
                part_out.data(), part_max.data(), part_sum.data(), b.q.data(), b.k.data(),
                b.v.data(), b.tables.data(), b.query_seq.data(), b.contexts.data(),
                b.max_blocks, b.block_size, b.q_heads, b.kv_heads, b.d, partitions, b.window,
                scale);
        }
    });
    emu::launch(dim3(b.q_heads, b.queries), dim3(128), [&] {
        paged_attention_reduce(out.data(), part_out.data(), part_max.data(), part_sum.data(),
                               b.contexts.data(), b.q_heads, b.d, partitions, b.window);
    });
    emu_io::Writer o(argv[2]);
    o.put(out);
    return o.close();
}
