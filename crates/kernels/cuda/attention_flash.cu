// Paged attention for prefill in the style of FlashAttention-2 (Dao 2023,
// <https://arxiv.org/abs/2307.08691>): a block takes a tile of up to FLASH_ROWS queries of
// one sequence for one query head and walks the keys they see in tiles of FLASH_KEYS
// positions, computing Q·Kᵀ and P·V on the tensor cores (`mma.sync` m16n8k16, bf16 inputs,
// f32 sums) with the softmax online in registers. Each K/V tile is read once for all the
// tile's queries, where the decode kernels read it once per query.
//
// Grid (q_heads, tiles); FLASH_WARPS warps, each owning 16 of the tile's rows. A tile is
// `tiles[2t]` = its first query, `tiles[2t + 1]` = its count (1 ..= FLASH_ROWS), all of one
// sequence (`flash_tiles` in `ops/flash.rs` makes them). Each row keeps its own context, so
// the mask is causal for a chunk of a prompt, and a sliding window of `window` positions
// (0: none) moves each row's first key. Cache layout: [blocks][block_size][kv_heads][D]
// bf16; q and the output: [queries][q_heads][D] f32, query head h reading KV head
// h / (q_heads / kv_heads).
//
// Rounding, which the CPU twin (`attention::flash_reference`) repeats: q is scaled by
// scale · log2(e) and rounded to bf16; the logits are f32 sums of bf16 products (base 2);
// each key tile's probabilities 2^(s − m), m the row's running maximum after that tile,
// are rounded to bf16, and both the P·V product and the row's sum use the rounded values,
// so that the output is a convex combination of V rows. The output is rounded to bf16
// into `out16` too when that is not null.

#define FLASH_WARPS 4
#define FLASH_ROWS 64
#define FLASH_KEYS 64
// Shared rows are padded by 8 bf16 (16 bytes): the fragment loads of a warp's 8 row
// groups then fall in distinct banks, and each row stays 16-byte aligned.
#define FLASH_PAD 8

// d += a · b for one warp: A 16×16 (row-major), B 16×8 ("col"), bf16 in, f32 sums. Lane
// L = 4·g + t holds A rows g and g + 8, columns 2t, 2t + 1 (a[0]: row g; a[1]: row g + 8)
// and 2t + 8, 2t + 9 (a[2], a[3]); B column g, rows 2t, 2t + 1 (b[0]) and 2t + 8, 2t + 9
// (b[1]); D rows g (d[0], d[1]) and g + 8 (d[2], d[3]), columns 2t, 2t + 1. In each
// 32-bit register the lower column (or row, for B) is the low half. A CPU emulation
// (TESSERA_EMULATE) supplies its own definition.
#ifndef TESSERA_EMULATE
__device__ __forceinline__ void mma_m16n8k16_bf16(
    float d[4],
    const unsigned int a[4],
    const unsigned int b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Two floats as a bf16 pair: `lo` (the lower index) in the low half.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    return (unsigned int)f32_to_bf16(lo) | ((unsigned int)f32_to_bf16(hi) << 16);
}

// The 32-bit word at bf16 index `at` of a shared row (`at` even).
__device__ __forceinline__ unsigned int shared_pair(const bf16_t* row, unsigned int at) {
    return *reinterpret_cast<const unsigned int*>(row + at);
}

// D: head_dim (16, 32, 64 or 128: a multiple of the mma's 16).
template <int D>
__device__ __forceinline__ void flash_attention(
    float* __restrict__ out,
    bf16_t* __restrict__ out16,
    const float* __restrict__ q,
    const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache,
    const unsigned int* __restrict__ block_tables,
    const unsigned int* __restrict__ query_seq,
    const unsigned int* __restrict__ context_lens,
    const unsigned int* __restrict__ tiles,
    unsigned int max_blocks,
    unsigned int block_size,
    unsigned int q_heads,
    unsigned int kv_heads,
    unsigned int window,
    float scale_log2) {
    constexpr int KSTEPS = D / 16;         // mma k-steps of Q·Kᵀ
    constexpr int STILES = FLASH_KEYS / 8; // n-tiles of a key tile's logits
    constexpr int PSTEPS = FLASH_KEYS / 16; // mma k-steps of P·V
    constexpr int OTILES = D / 8;          // n-tiles of the output
    constexpr int CHUNKS = D / 8;          // 16-byte loads per cached row
    // K as stored: [key][dim]; V transposed: [dim][key], so that both B fragments are
    // 32-bit loads of two consecutive bf16.
    __shared__ __align__(16) bf16_t s_k[FLASH_KEYS][D + FLASH_PAD];
    __shared__ __align__(16) bf16_t s_vt[D][FLASH_KEYS + FLASH_PAD];
    __shared__ unsigned int s_span[2];

    const unsigned int head = blockIdx.x;
    const unsigned int tile = blockIdx.y;
    const unsigned int first = tiles[2u * tile];
    const unsigned int count = tiles[2u * tile + 1u];
    const unsigned int kv_head = head / (q_heads / kv_heads);
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int g = lane >> 2;
    const unsigned int t = lane & 3u;

    // The tile's keys: from the lowest first key of its rows to the longest context.
    if (threadIdx.x == 0) {
        unsigned int lo = 0xffffffffu;
        unsigned int hi = 0u;
        for (unsigned int r = 0; r < count; ++r) {
            const unsigned int c = context_lens[first + r];
            lo = min(lo, window_start(c, window));
            hi = max(hi, c);
        }
        s_span[0] = lo;
        s_span[1] = hi;
    }
    __syncthreads();
    const unsigned int tile_lo = s_span[0];
    const unsigned int tile_hi = s_span[1];

    // This thread's two rows (g and g + 8 of its warp's 16): their keys [lo, hi).
    const unsigned int rows[2] = {warp * 16u + g, warp * 16u + g + 8u};
    unsigned int lo[2];
    unsigned int hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        hi[r] = rows[r] < count ? context_lens[first + rows[r]] : 0u;
        lo[r] = hi[r] != 0u ? window_start(hi[r], window) : 0xffffffffu;
    }
    // The warp's keys, so that a key tile none of its rows sees costs no mma.
    unsigned int warp_lo = min(lo[0], lo[1]);
    unsigned int warp_hi = max(hi[0], hi[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        warp_lo = min(warp_lo, __shfl_xor_sync(0xffffffffu, warp_lo, o));
        warp_hi = max(warp_hi, __shfl_xor_sync(0xffffffffu, warp_hi, o));
    }

    // Q's A fragments, scaled to base-2 logits and rounded to bf16 (0 past the tile).
    unsigned int qa[KSTEPS][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool valid = rows[r] < count;
        const float* row = q + ((size_t)(first + rows[r]) * q_heads + head) * D;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            float2 a = make_float2(0.0f, 0.0f);
            float2 b = a;
            if (valid) {
                a = *reinterpret_cast<const float2*>(row + kk * 16 + 2 * t);
                b = *reinterpret_cast<const float2*>(row + kk * 16 + 2 * t + 8);
            }
            qa[kk][r] = pack_bf16x2(a.x * scale_log2, a.y * scale_log2);
            qa[kk][r + 2] = pack_bf16x2(b.x * scale_log2, b.y * scale_log2);
        }
    }

    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    float o[OTILES][4];
#pragma unroll
    for (int n = 0; n < OTILES; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }

    const unsigned int* table = block_tables + (size_t)query_seq[first] * max_blocks;
    for (unsigned int base = tile_lo; base < tile_hi; base += FLASH_KEYS) {
        // The key tile into shared memory: 16-byte loads, zeros past the tile's keys (a
        // masked logit's weight is 0, and 0 · 0 keeps the sums finite).
        for (unsigned int i = threadIdx.x; i < FLASH_KEYS * CHUNKS; i += blockDim.x) {
            const unsigned int key = i / CHUNKS;
            const unsigned int chunk = i % CHUNKS;
            const unsigned int pos = base + key;
            uint4 kr = make_uint4(0u, 0u, 0u, 0u);
            uint4 vr = kr;
            if (pos < tile_hi) {
                const size_t slot =
                    (size_t)table[pos / block_size] * block_size + pos % block_size;
                const size_t at = (slot * kv_heads + kv_head) * D + chunk * 8u;
                kr = *reinterpret_cast<const uint4*>(k_cache + at);
                vr = *reinterpret_cast<const uint4*>(v_cache + at);
            }
            *reinterpret_cast<uint4*>(&s_k[key][chunk * 8u]) = kr;
            const unsigned int words[4] = {vr.x, vr.y, vr.z, vr.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                s_vt[chunk * 8u + 2u * w][key] = (bf16_t)(words[w] & 0xffffu);
                s_vt[chunk * 8u + 2u * w + 1u][key] = (bf16_t)(words[w] >> 16);
            }
        }
        __syncthreads();

        if (base < warp_hi && base + FLASH_KEYS > warp_lo) {
            // S = Q·Kᵀ for the warp's 16 rows and the tile's keys.
            float s[STILES][4];
#pragma unroll
            for (int j = 0; j < STILES; ++j) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    const bf16_t* krow = s_k[j * 8 + g];
                    const unsigned int b[2] = {
                        shared_pair(krow, kk * 16 + 2 * t),
                        shared_pair(krow, kk * 16 + 2 * t + 8),
                    };
                    mma_m16n8k16_bf16(s[j], qa[kk], b);
                }
            }
            // The mask, and each row's maximum over the tile (the 4 lanes of a row group
            // hold its columns).
            float top[2] = {m[0], m[1]};
#pragma unroll
            for (int j = 0; j < STILES; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const unsigned int key = base + j * 8 + 2 * t + (e & 1);
                    if (key < lo[r] || key >= hi[r]) {
                        s[j][e] = -INFINITY;
                    }
                    top[r] = fmaxf(top[r], s[j][e]);
                }
            }
            float rescale[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 1));
                top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 2));
                // A row with no key yet keeps all zeros (and -inf − -inf is no number).
                rescale[r] = top[r] == -INFINITY ? 1.0f : exp2f(m[r] - top[r]);
                m[r] = top[r];
                l[r] *= rescale[r];
            }
            // P in bf16: the same values weigh V and add to the row's sum.
#pragma unroll
            for (int j = 0; j < STILES; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const float p =
                        s[j][e] == -INFINITY ? 0.0f : bf16_to_f32(f32_to_bf16(exp2f(s[j][e] - m[r])));
                    s[j][e] = p;
                    l[r] += p;
                }
            }
#pragma unroll
            for (int n = 0; n < OTILES; ++n) {
                o[n][0] *= rescale[0];
                o[n][1] *= rescale[0];
                o[n][2] *= rescale[1];
                o[n][3] *= rescale[1];
            }
            // O += P·V: P's C fragments of two key n-tiles are the A fragment of one
            // 16-key k-step.
#pragma unroll
            for (int kk = 0; kk < PSTEPS; ++kk) {
                const unsigned int pa[4] = {
                    pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                    pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                    pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                    pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
                };
#pragma unroll
                for (int n = 0; n < OTILES; ++n) {
                    const bf16_t* vrow = s_vt[n * 8 + g];
                    const unsigned int b[2] = {
                        shared_pair(vrow, kk * 16 + 2 * t),
                        shared_pair(vrow, kk * 16 + 2 * t + 8),
                    };
                    mma_m16n8k16_bf16(o[n], pa, b);
                }
            }
        }
        __syncthreads();
    }

    // Each row's sum over its 4 lanes, then the normalised output.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] >= count) {
            continue;
        }
        // A row sees at least its own position, whose weight is 2^0 = 1: l ≥ 1.
        const float inv = 1.0f / l[r];
        const size_t at = ((size_t)(first + rows[r]) * q_heads + head) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < OTILES; ++n) {
            const float x = o[n][2 * r] * inv;
            const float y = o[n][2 * r + 1] * inv;
            *reinterpret_cast<float2*>(out + at + n * 8) = make_float2(x, y);
            if (out16 != 0) {
                out16[at + n * 8] = f32_to_bf16(x);
                out16[at + n * 8 + 1] = f32_to_bf16(y);
            }
        }
    }
}

#define FLASH_PARAMS                                                                        \
    float *out, bf16_t *out16, const float *q, const bf16_t *k_cache, const bf16_t *v_cache, \
        const unsigned int *block_tables, const unsigned int *query_seq,                    \
        const unsigned int *context_lens, const unsigned int *tiles, unsigned int max_blocks, \
        unsigned int block_size, unsigned int q_heads, unsigned int kv_heads,                \
        unsigned int window, float scale_log2
#define FLASH_ARGS                                                                          \
    out, out16, q, k_cache, v_cache, block_tables, query_seq, context_lens, tiles,          \
        max_blocks, block_size, q_heads, kv_heads, window, scale_log2

// One entry per head_dim; the host picks it.
extern "C" __global__ __launch_bounds__(128) void attention_flash_d16(FLASH_PARAMS) {
    flash_attention<16>(FLASH_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_flash_d32(FLASH_PARAMS) {
    flash_attention<32>(FLASH_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_flash_d64(FLASH_PARAMS) {
    flash_attention<64>(FLASH_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_flash_d128(FLASH_PARAMS) {
    flash_attention<128>(FLASH_ARGS);
}
