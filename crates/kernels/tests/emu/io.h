// The emulated kernels' drivers (`*_main.cpp`) read their inputs from the file
// `crates/kernels/tests/emulated.rs` writes and write their outputs back: little-endian
// arrays one after another, as each driver's top comment lays out.

#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace emu_io {

class Reader {
public:
    explicit Reader(const char* path) : f_(fopen(path, "rb")) {
        if (f_ == nullptr) {
            perror(path);
            exit(2);
        }
    }
    ~Reader() { fclose(f_); }

    // The next `n` values of type T; exits with 2 where the file ends early.
    template <class T>
    std::vector<T> take(size_t n) {
        std::vector<T> v(n);
        if (n != 0 && fread(v.data(), sizeof(T), n, f_) != n) {
            fprintf(stderr, "emu_io: the input ends early\n");
            exit(2);
        }
        return v;
    }

private:
    FILE* f_;
};

class Writer {
public:
    explicit Writer(const char* path) : f_(fopen(path, "wb")) {
        if (f_ == nullptr) {
            perror(path);
            exit(2);
        }
    }

    template <class T>
    void put(const std::vector<T>& v) {
        if (fwrite(v.data(), sizeof(T), v.size(), f_) != v.size()) {
            fprintf(stderr, "emu_io: a write failed\n");
            exit(2);
        }
    }

    // 0 when everything reached the file, else 2 (the driver's exit status).
    int close() { return fclose(f_) == 0 ? 0 : 2; }

private:
    FILE* f_;
};

// What both attention drivers read first: a header of 10 u32 — head_dim, q_heads,
// kv_heads, block_size, max_blocks, window, queries, sequences, cache blocks, and the
// driver's own last word (`last`) — and the f32 scale_log2; then the block tables (u32,
// sequences × max_blocks), query_seq and contexts (u32, queries each), K and V (bf16 bits,
// cache blocks × block_size × kv_heads × head_dim each), and q (f32, queries × q_heads ×
// head_dim). What a driver reads after that is its own.
struct PagedBatch {
    unsigned int d, q_heads, kv_heads, block_size, max_blocks, window, queries, seqs, blocks;
    unsigned int last;
    float scale_log2;
    std::vector<unsigned int> tables, query_seq, contexts;
    std::vector<unsigned short> k, v;
    std::vector<float> q;

    explicit PagedBatch(Reader& in) {
        const std::vector<unsigned int> h = in.take<unsigned int>(10);
        d = h[0], q_heads = h[1], kv_heads = h[2], block_size = h[3], max_blocks = h[4];
        window = h[5], queries = h[6], seqs = h[7], blocks = h[8], last = h[9];
        scale_log2 = in.take<float>(1)[0];
        tables = in.take<unsigned int>((size_t)seqs * max_blocks);
        query_seq = in.take<unsigned int>(queries);
        contexts = in.take<unsigned int>(queries);
        const size_t pool = (size_t)blocks * block_size * kv_heads * d;
        k = in.take<unsigned short>(pool);
        v = in.take<unsigned short>(pool);
        q = in.take<float>((size_t)queries * q_heads * d);
    }
};

} // namespace emu_io
