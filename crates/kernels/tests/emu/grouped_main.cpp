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
#include "grouped.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: grouped_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const emu_io::PagedBatch b(in);
    const unsigned int d = b.d, q_heads = b.q_heads, partitions = b.last;

    const unsigned int group = q_heads / b.kv_heads;
    const GroupedKernel kernel = grouped_entry(d, group);
    if (kernel == nullptr || partitions == 0 || partitions > GROUPED_MAX_PARTITIONS) {
        fprintf(stderr, "grouped_main: no kernel for head_dim %u, group %u, %u partitions\n",
                d, group, partitions);
        return 2;
    }
    GroupedRun run(b, partitions);
    run.launch(b, partitions, [&](float* out, bf16_t* out16, float* part_out,
                                  float* part_max, float* part_sum) {
        kernel(out, out16, part_out, part_max, part_sum, b.q.data(), b.k.data(), b.v.data(),
               b.tables.data(), b.query_seq.data(), b.contexts.data(), b.max_blocks,
               b.block_size, q_heads, b.kv_heads, partitions, b.window, b.scale_log2,
               nullptr, nullptr, nullptr, nullptr, nullptr, 0u, nullptr, nullptr);
    });
    emu_io::Writer o(argv[2]);
    o.put(run.out);
    o.put(run.out16);
    return o.close();
}
