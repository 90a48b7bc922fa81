// Runs the grouped decode attention kernel in its append mode (the fused decode step:
// crates/kernels/cuda/attention_grouped.cu with `qkv` given) under the CPU emulation of
// cuda_emu.h: each query, the one new token of its sequence, is rotated from its row of the
// stacked q|k|v projection and its K and V written into the cache by the attention launch
// itself; split into the partitions asked for and merged by the reduce. Inputs from
// `crates/kernels/tests/emulated.rs`; outputs back to it.
//
//   append_main INPUT OUTPUT
//
// INPUT (little-endian): an `emu_io::PagedBatch` (io.h) whose last header word is the
// count of partitions (its q is not read), then u32 pairing (0: halves, 1: interleaved)
// and u32 has_bias, the stacked rows (f32, queries × (q_heads + 2 kv_heads) × head_dim),
// the bias (f32, one row) where has_bias, the positions (u32, queries), inv_freq (f32,
// head_dim / 2) and the cache slots (i64, queries; negative: padding, not written).
// OUTPUT: the output (f32) and its bf16 copy (u16 bits), each queries × q_heads ×
// head_dim, then the K and V caches after the launch (bf16 bits).
//
// With 0 partitions it runs what the fused path launches before any attention kernel
// in a prefill or mixed batch instead: `rope_kv_write` (crates/kernels/cuda/rope_kv.cu;
// a block of 256 threads per token) on the same inputs. OUTPUT: the rotated queries
// (f32, queries × q_heads × head_dim), then the K and V caches after the launch.

#include "cuda_emu.h"
#include "prelude.cuh"
#include "attention_grouped.cu"
#include "rope_kv.cu"

#include "io.h"
#include "grouped.h"

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: append_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    emu_io::PagedBatch b(in);
    const unsigned int d = b.d, q_heads = b.q_heads, queries = b.queries, partitions = b.last;
    const unsigned int pairing = in.take<unsigned int>(1)[0];
    const bool has_bias = in.take<unsigned int>(1)[0] != 0;
    const size_t row = (size_t)(q_heads + 2 * b.kv_heads) * d;
    const auto qkv = in.take<float>(queries * row);
    const auto bias = in.take<float>(has_bias ? row : 0);
    const auto positions = in.take<unsigned int>(queries);
    const auto inv_freq = in.take<float>(d / 2);
    const auto slots = in.take<long long>(queries);

    emu_io::Writer o(argv[2]);
    if (partitions == 0) {
        std::vector<float> q_out((size_t)queries * q_heads * d, NAN);
        emu::launch(dim3(queries), dim3(256), [&] {
            rope_kv_write(q_out.data(), b.k.data(), b.v.data(), qkv.data(),
                          has_bias ? bias.data() : nullptr, positions.data(), inv_freq.data(),
                          slots.data(), q_heads, b.kv_heads, d, pairing);
        });
        o.put(q_out);
        o.put(b.k);
        o.put(b.v);
        return o.close();
    }
    const GroupedKernel kernel = grouped_entry(d, q_heads / b.kv_heads);
    if (kernel == nullptr || partitions == 0 || partitions > GROUPED_MAX_PARTITIONS) {
        fprintf(stderr, "append_main: no kernel for head_dim %u, %u partitions\n", d,
                partitions);
        return 2;
    }
    GroupedRun run(b, partitions);
    run.launch(b, partitions, [&](float* out, bf16_t* out16, float* part_out,
                                  float* part_max, float* part_sum) {
        kernel(out, out16, part_out, part_max, part_sum, nullptr, b.k.data(), b.v.data(),
               b.tables.data(), b.query_seq.data(), b.contexts.data(), b.max_blocks,
               b.block_size, q_heads, b.kv_heads, partitions, b.window, b.scale_log2,
               qkv.data(), has_bias ? bias.data() : nullptr, positions.data(),
               inv_freq.data(), slots.data(), pairing, b.k.data(), b.v.data());
    });
    o.put(run.out);
    o.put(run.out16);
    o.put(b.k);
    o.put(b.v);
    return o.close();
}
