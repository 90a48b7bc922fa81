// Runs the kernels that read or write a table of bf16 or, on the exact path, f32 values
// (crates/kernels/cuda/embedding.cu's gather and kv_write.cu's cache write, each entry of
// both types) under the CPU emulation of cuda_emu.h, launched as `Ops::embedding` and
// `Ops::kv_write` launch them (a block of 256 threads per token), on inputs that
// `crates/kernels/tests/emulated.rs` writes; writes their outputs back for that test.
//
//   tables_main INPUT OUTPUT
//
// INPUT (little-endian): u32 f32 (0: the bf16 entries, 1: the f32 ones), u32 hidden, rows,
// vocab_start, tokens, kv_width and slots (the cache's), then the table (rows × hidden
// values: u16 bf16 bits or f32), the token ids (u32, tokens), K and V (f32, tokens ×
// kv_width each) and the slots (i64, tokens; negative: not written). OUTPUT: the gathered
// rows (f32, tokens × hidden), then the K and V caches (slots × kv_width values each, of
// the table's type; every value not written stays all ones).

#include "cuda_emu.h"
#include "prelude.cuh"
#include "embedding.cu"
#include "kv_write.cu"

#include <cstring>

#include "io.h"

// One type's run: the gather, then the cache write.
template <class T, class Gather, class Write>
int run(emu_io::Reader& in, emu_io::Writer& o, const std::vector<unsigned int>& h,
        Gather gather, Write write) {
    const unsigned int hidden = h[1], rows = h[2], vocab_start = h[3], tokens = h[4];
    const unsigned int kv_width = h[5], slots_n = h[6];
    const auto table = in.take<T>((size_t)rows * hidden);
    const auto ids = in.take<unsigned int>(tokens);
    const auto k = in.take<float>((size_t)tokens * kv_width);
    const auto v = in.take<float>((size_t)tokens * kv_width);
    const auto slots = in.take<long long>(tokens);
    std::vector<float> out((size_t)tokens * hidden, NAN);
    emu::launch(dim3(tokens), dim3(256), [&] {
        gather(out.data(), table.data(), ids.data(), hidden, vocab_start, rows);
    });
    T ones;
    memset(&ones, 0xff, sizeof ones);
    std::vector<T> k_cache((size_t)slots_n * kv_width, ones), v_cache = k_cache;
    emu::launch(dim3(tokens), dim3(256), [&] {
        write(k_cache.data(), v_cache.data(), k.data(), v.data(), slots.data(), kv_width);
    });
    o.put(out);
    o.put(k_cache);
    o.put(v_cache);
    return o.close();
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: tables_main INPUT OUTPUT\n");
        return 2;
    }
    emu_io::Reader in(argv[1]);
    const std::vector<unsigned int> h = in.take<unsigned int>(7);
    emu_io::Writer o(argv[2]);
    if (h[0] == 0) {
        return run<bf16_t>(in, o, h, embedding_gather_bf16, kv_write_bf16);
    }
    if (h[0] == 1) {
        return run<float>(in, o, h, embedding_gather_f32, kv_write_f32);
    }
    fprintf(stderr, "tables_main: no table type %u\n", h[0]);
    return 2;
}
