// Paged attention with one thread block per (query, KV head) serving every query head of
// that KV head's group (GQA), so each cached K/V byte is read once per query, in 16-byte
// loads; the design of Flash-Decoding (Dao, Haziza, Massa, Sizov 2023,
// <https://crfm.stanford.edu/2023/10/12/flashdecoding.html>): an online softmax (running
// maximum, running sum, rescaled accumulator) in registers, and a split along the context
// only when the batch's blocks do not fill the GPU, merged by `attention_grouped_reduce`.
//
// Grid (kv_heads, queries, partitions); blocks of GROUPED_WARPS warps. Each query is a
// block row of its own with its own context, so decode (one query per sequence) and
// chunked prefill (a chunk's tokens, each seeing its position + 1: causal) both run here.
// Cache layout: [blocks][block_size][kv_heads][head_dim] bf16 (`kv_write_bf16`); q and the
// output: [queries][q_heads][head_dim] f32, query head h reading KV head h / group.
//
// Inside a block, a warp reads SLOTS positions at once: LANES = head_dim / 8 lanes per
// position, each lane 8 dimensions (one uint4 of K, one of V), GROUPED_UNROLL such steps
// per iteration so that several loads are in flight. Each slot keeps its own running
// softmax for the group's heads; slots merge through shuffles, warps through shared memory.
//
// Split: the launch has `partitions` blocks along z; a query that attends to `span`
// positions uses ceil(span / len) of them, len = grouped_part_len(span, partitions) (the
// same in both kernels, so a graph captured with the longest context serves shorter ones).
// `span` is the context, or under a sliding window of `window` positions (0: none) the
// last `window` of it, from `window_start`. A query that uses one partition is written,
// normalised, by this kernel; the reduce skips it. Softmax runs in base 2: q is scaled by
// scale · log2(e), so the partitions' maxima are base-2 logits too. `out16`, when not
// null, receives the output rounded to bf16 as well (the o projection's GEMM input, so no
// round_bf16 launch follows). Twin: `attention::paged_attention` over the CPU cache.
//
// Append mode (`qkv` not null; a decode step of the fused path): `q` is not read; each
// block takes its queries from the stacked q|k|v projection and does `rope_kv_write`'s
// work for its KV head first (`append_fresh`), so that no separate launch writes the
// step's K and V. Twin: `fused::rope_kv_write`, then `attention::paged_attention`.

#define GROUPED_WARPS 4
#define GROUPED_UNROLL 2
// The shortest partition: below it a split costs more (a reduce) than it spreads.
#define GROUPED_MIN_PART 64
// The most partitions a launch may have (the reduce's shared weights).
#define GROUPED_MAX_PARTITIONS 64

// Positions per partition of a context of `context` positions split at most `partitions`
// ways: at least GROUPED_MIN_PART, a multiple of 16, and ceil(context / len) ≤ partitions.
// Mirrored by `grouped_part_len` in `ops/attention.rs`.
__device__ __forceinline__ unsigned int grouped_part_len(
    unsigned int context,
    unsigned int partitions) {
    const unsigned int even = (context + partitions - 1u) / partitions;
    return max((unsigned int)GROUPED_MIN_PART, (even + 15u) & ~15u);
}

// The append mode's inputs, as `append_fresh` and `grouped_attention` take them (null
// `qkv`: not in append mode).
#define APPEND_PARAMS                                                                       \
    const float* __restrict__ qkv, const float* __restrict__ bias,                          \
        const unsigned int* __restrict__ positions, const float* __restrict__ inv_freq,     \
        const long long* __restrict__ slots, unsigned int pairing, bf16_t* k_fresh,         \
        bf16_t* v_fresh
#define APPEND_ARGS qkv, bias, positions, inv_freq, slots, pairing, k_fresh, v_fresh

// Append mode (a decode step, each query the one new token of its sequence, at position
// context − 1): the work of `rope_kv_write` for this block's KV head, fused into the
// attention launch. Every partition rotates its group's q heads (q|k|v row + bias) into
// `s_q`; the partition holding position `fresh` also rotates the KV head's k, rounds k
// and v to bf16 into `s_k` / `s_v` and writes them to the token's cache slot (none for a
// negative slot: padding). Returns the position the attention loop reads from `s_k` /
// `s_v`, or none when this partition does not hold it. Twin: `fused::rope_kv_write`, then
// `attention::paged_attention`.
template <int D, int G>
__device__ __forceinline__ unsigned int append_fresh(
    float (*s_q)[D],
    bf16_t* s_k,
    bf16_t* s_v,
    APPEND_PARAMS,
    unsigned int query,
    unsigned int kv_head,
    unsigned int first_head,
    unsigned int group,
    unsigned int q_heads,
    unsigned int kv_heads,
    unsigned int fresh,
    unsigned int start,
    unsigned int end) {
    constexpr unsigned int HALF = D / 2;
    const float* row = qkv + (size_t)query * (q_heads + 2u * kv_heads) * D;
    const float pos = (float)positions[query];
    const long long slot = slots[query];
    const bool holds = fresh >= start && fresh < end;
    const size_t dst = (size_t)slot * kv_heads * D + (size_t)kv_head * D;
    // The group's q heads' pairs, then (where this partition holds the fresh position)
    // the k head's.
    const unsigned int pairs = (group + (holds ? 1u : 0u)) * HALF;
    for (unsigned int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const unsigned int h = p / HALF;
        const unsigned int i = p % HALF;
        const unsigned int a = pairing == 0 ? i : 2 * i;
        const unsigned int b = pairing == 0 ? i + HALF : 2 * i + 1;
        const unsigned int col = h < group ? (first_head + h) * D : (q_heads + kv_head) * D;
        float x = row[col + a];
        float y = row[col + b];
        if (bias != 0) {
            x += bias[col + a];
            y += bias[col + b];
        }
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float xr = x * c - y * s;
        const float yr = y * c + x * s;
        if (h < group) {
            s_q[h][a] = xr;
            s_q[h][b] = yr;
        } else {
            s_k[a] = f32_to_bf16(xr);
            s_k[b] = f32_to_bf16(yr);
            if (slot >= 0) {
                k_fresh[dst + a] = s_k[a];
                k_fresh[dst + b] = s_k[b];
            }
        }
    }
    if (holds) {
        const unsigned int col = (q_heads + kv_heads + kv_head) * D;
        for (unsigned int i = threadIdx.x; i < D; i += blockDim.x) {
            float value = row[col + i];
            if (bias != 0) {
                value += bias[col + i];
            }
            s_v[i] = f32_to_bf16(value);
            if (slot >= 0) {
                v_fresh[dst + i] = s_v[i];
            }
        }
    }
    __syncthreads();
    return holds ? fresh : 0xffffffffu;
}

// D: head_dim (16, 32, 64 or 128: LANES = D / 8 divides a warp). G: the group's query heads, rounded up to 1, 2, 4 or 8; heads
// past the real group (q_heads / kv_heads) get q = 0 and are not written.
template <int D, int G>
__device__ __forceinline__ void grouped_attention(
    float* __restrict__ out,
    bf16_t* __restrict__ out16,
    float* __restrict__ part_out,
    float* __restrict__ part_max,
    float* __restrict__ part_sum,
    const float* __restrict__ q,
    const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache,
    const unsigned int* __restrict__ block_tables,
    const unsigned int* __restrict__ query_seq,
    const unsigned int* __restrict__ context_lens,
    unsigned int max_blocks,
    unsigned int block_size,
    unsigned int q_heads,
    unsigned int kv_heads,
    unsigned int partitions,
    unsigned int window,
    float scale_log2,
    APPEND_PARAMS) {
    constexpr unsigned int LANES = D / 8;
    constexpr unsigned int SLOTS = 32 / LANES;
    constexpr unsigned int STEP = GROUPED_UNROLL * GROUPED_WARPS * SLOTS;
    __shared__ float s_acc[GROUPED_WARPS][G][D];
    __shared__ float s_max[GROUPED_WARPS][G];
    __shared__ float s_sum[GROUPED_WARPS][G];
    // Append mode: the group's rotated q, and the fresh position's K and V as written.
    __shared__ __align__(16) float s_q[G][D];
    __shared__ __align__(16) bf16_t s_k[D];
    __shared__ __align__(16) bf16_t s_v[D];

    const unsigned int kv_head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const unsigned int part = blockIdx.z;
    const unsigned int context = context_lens[query];
    const unsigned int lo = window_start(context, window);
    const unsigned int len = grouped_part_len(context - lo, partitions);
    const unsigned int start = lo + part * len;
    // Past this query's context: nothing to do (a graph launches the partitions of its
    // longest context for every query).
    if (start >= context) {
        return;
    }
    const unsigned int end = min(start + len, context);
    const unsigned int group = q_heads / kv_heads;
    const unsigned int first_head = kv_head * group;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int slot = lane / LANES;
    const unsigned int sub = lane % LANES;

    // Append mode: the position this query's K and V are written at; none otherwise.
    const unsigned int fresh = qkv != 0
        ? append_fresh<D, G>(s_q, s_k, s_v, APPEND_ARGS, query, kv_head, first_head, group,
                             q_heads, kv_heads, context - 1u, start, end)
        : 0xffffffffu;

    // This lane's 8 dimensions of each head's q, in base-2 logit units.
    float qv[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 b = a;
        if ((unsigned int)g < group) {
            const float4* src = qkv != 0
                ? reinterpret_cast<const float4*>(&s_q[g][sub * 8])
                : reinterpret_cast<const float4*>(
                      q + ((size_t)query * q_heads + first_head + g) * D + sub * 8);
            a = src[0];
            b = src[1];
        }
        qv[g][0] = a.x * scale_log2;
        qv[g][1] = a.y * scale_log2;
        qv[g][2] = a.z * scale_log2;
        qv[g][3] = a.w * scale_log2;
        qv[g][4] = b.x * scale_log2;
        qv[g][5] = b.y * scale_log2;
        qv[g][6] = b.z * scale_log2;
        qv[g][7] = b.w * scale_log2;
    }
    float m[G];
    float l[G];
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[g][i] = 0.0f;
        }
    }

    const unsigned int* table = block_tables + (size_t)query_seq[query] * max_blocks;
    // Every warp runs the same iterations (the shuffles need all 32 lanes).
    for (unsigned int base = start; base < end; base += STEP) {
        uint4 kr[GROUPED_UNROLL];
        uint4 vr[GROUPED_UNROLL];
        bool valid[GROUPED_UNROLL];
#pragma unroll
        for (int u = 0; u < GROUPED_UNROLL; ++u) {
            const unsigned int pos = base + (u * GROUPED_WARPS + warp) * SLOTS + slot;
            valid[u] = pos < end;
            kr[u] = make_uint4(0u, 0u, 0u, 0u);
            vr[u] = kr[u];
            if (valid[u] && pos == fresh) {
                // Written by this block: read back from shared memory, not through the
                // read-only cache path of k_cache / v_cache.
                kr[u] = reinterpret_cast<const uint4*>(s_k)[sub];
                vr[u] = reinterpret_cast<const uint4*>(s_v)[sub];
            } else if (valid[u]) {
                const size_t row =
                    (size_t)table[pos / block_size] * block_size + pos % block_size;
                const size_t at = (row * kv_heads + kv_head) * D + sub * 8;
                kr[u] = *reinterpret_cast<const uint4*>(k_cache + at);
                vr[u] = *reinterpret_cast<const uint4*>(v_cache + at);
            }
        }
        // Each head's logit of each position: 8 products here, summed over the slot's lanes.
        float s[GROUPED_UNROLL][G];
#pragma unroll
        for (int u = 0; u < GROUPED_UNROLL; ++u) {
            float kf[8];
            unpack_bf16x8(kr[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    dot = fmaf(qv[g][i], kf[i], dot);
                }
#pragma unroll
                for (unsigned int o = LANES / 2; o > 0; o >>= 1) {
                    dot += __shfl_xor_sync(0xffffffffu, dot, o);
                }
                s[u][g] = valid[u] ? dot : -INFINITY;
            }
        }
        float vf[GROUPED_UNROLL][8];
#pragma unroll
        for (int u = 0; u < GROUPED_UNROLL; ++u) {
            unpack_bf16x8(vr[u], vf[u]);
        }
        // Online softmax: rescale what was summed under the old maximum.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float top = m[g];
#pragma unroll
            for (int u = 0; u < GROUPED_UNROLL; ++u) {
                top = fmaxf(top, s[u][g]);
            }
            if (top == -INFINITY) {
                continue; // no position of this slot in this step
            }
            const float rescale = exp2f(m[g] - top);
            m[g] = top;
            float p[GROUPED_UNROLL];
            float sum = l[g] * rescale;
#pragma unroll
            for (int u = 0; u < GROUPED_UNROLL; ++u) {
                p[u] = exp2f(s[u][g] - top);
                sum += p[u];
            }
            l[g] = sum;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float a = acc[g][i] * rescale;
#pragma unroll
                for (int u = 0; u < GROUPED_UNROLL; ++u) {
                    a = fmaf(p[u], vf[u][i], a);
                }
                acc[g][i] = a;
            }
        }
    }

    // The warp's slots merge (lanes with the same dimensions, LANES apart).
#pragma unroll
    for (unsigned int o = LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
            float acc_o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc_o[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
            }
            const float top = fmaxf(m[g], m_o);
            if (top != -INFINITY) {
                const float a = exp2f(m[g] - top);
                const float b = exp2f(m_o - top);
                l[g] = l[g] * a + l_o * b;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[g][i] = acc[g][i] * a + acc_o[i] * b;
                }
                m[g] = top;
            }
        }
    }
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                s_acc[warp][g][sub * 8 + i] = acc[g][i];
            }
            if (sub == 0) {
                s_max[warp][g] = m[g];
                s_sum[warp][g] = l[g];
            }
        }
    }
    __syncthreads();

    // The warps merge: one thread per (head, dimension). The partition holds at least one
    // position, so some warp's maximum is finite and the sum is at least 1.
    const bool split = len < context - lo;
    for (unsigned int at = threadIdx.x; at < group * D; at += blockDim.x) {
        const unsigned int g = at / D;
        const unsigned int d = at % D;
        float top = -INFINITY;
#pragma unroll
        for (int w = 0; w < GROUPED_WARPS; ++w) {
            top = fmaxf(top, s_max[w][g]);
        }
        float sum = 0.0f;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < GROUPED_WARPS; ++w) {
            const float e = exp2f(s_max[w][g] - top);
            sum += s_sum[w][g] * e;
            o += s_acc[w][g][d] * e;
        }
        const size_t row = (size_t)query * q_heads + first_head + g;
        if (!split) {
            const float value = o / sum;
            out[row * D + d] = value;
            if (out16 != 0) {
                out16[row * D + d] = f32_to_bf16(value);
            }
        } else {
            const size_t slot_at = row * partitions + part;
            part_out[slot_at * D + d] = o;
            if (d == 0) {
                part_max[slot_at] = top;
                part_sum[slot_at] = sum;
            }
        }
    }
}

#define GROUPED_PARAMS                                                                      \
    float *out, bf16_t *out16, float *part_out, float *part_max, float *part_sum,            \
        const float *q,                                                                     \
        const bf16_t *k_cache, const bf16_t *v_cache, const unsigned int *block_tables,     \
        const unsigned int *query_seq, const unsigned int *context_lens,                    \
        unsigned int max_blocks, unsigned int block_size, unsigned int q_heads,             \
        unsigned int kv_heads, unsigned int partitions, unsigned int window,                \
        float scale_log2, const float *qkv,                                                 \
        const float *bias, const unsigned int *positions, const float *inv_freq,            \
        const long long *slots, unsigned int pairing, bf16_t *k_fresh, bf16_t *v_fresh
#define GROUPED_ARGS                                                                        \
    out, out16, part_out, part_max, part_sum, q, k_cache, v_cache, block_tables,            \
        query_seq, context_lens, max_blocks, block_size, q_heads, kv_heads, partitions,     \
        window, scale_log2, qkv, bias, positions, inv_freq, slots, pairing, k_fresh, v_fresh

// One entry per (head_dim, group rounded up to a power of two); the host picks it.
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d16_g1(GROUPED_PARAMS) {
    grouped_attention<16, 1>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d16_g2(GROUPED_PARAMS) {
    grouped_attention<16, 2>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d16_g4(GROUPED_PARAMS) {
    grouped_attention<16, 4>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d16_g8(GROUPED_PARAMS) {
    grouped_attention<16, 8>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d32_g1(GROUPED_PARAMS) {
    grouped_attention<32, 1>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d32_g2(GROUPED_PARAMS) {
    grouped_attention<32, 2>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d32_g4(GROUPED_PARAMS) {
    grouped_attention<32, 4>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d32_g8(GROUPED_PARAMS) {
    grouped_attention<32, 8>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d64_g1(GROUPED_PARAMS) {
    grouped_attention<64, 1>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d64_g2(GROUPED_PARAMS) {
    grouped_attention<64, 2>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d64_g4(GROUPED_PARAMS) {
    grouped_attention<64, 4>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d64_g8(GROUPED_PARAMS) {
    grouped_attention<64, 8>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d128_g1(GROUPED_PARAMS) {
    grouped_attention<128, 1>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d128_g2(GROUPED_PARAMS) {
    grouped_attention<128, 2>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d128_g4(GROUPED_PARAMS) {
    grouped_attention<128, 4>(GROUPED_ARGS);
}
extern "C" __global__ __launch_bounds__(128) void attention_grouped_d128_g8(GROUPED_PARAMS) {
    grouped_attention<128, 8>(GROUPED_ARGS);
}

// Merges the partitions of each (query head, query) that used more than one: grid
// (q_heads, queries), one thread per dimension. Partition p's output is unnormalised,
// relative to its base-2 maximum; the merge weights each by 2^(max_p − max).
extern "C" __global__ __launch_bounds__(128) void attention_grouped_reduce(
    float* __restrict__ out,
    bf16_t* __restrict__ out16,
    const float* __restrict__ part_out,
    const float* __restrict__ part_max,
    const float* __restrict__ part_sum,
    const unsigned int* __restrict__ context_lens,
    unsigned int q_heads,
    unsigned int head_dim,
    unsigned int partitions,
    unsigned int window) {
    __shared__ float weight[GROUPED_MAX_PARTITIONS];
    __shared__ float total;
    const unsigned int head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const unsigned int context = context_lens[query];
    const unsigned int span = context - window_start(context, window);
    const unsigned int len = grouped_part_len(span, partitions);
    const unsigned int used = (span + len - 1u) / len;
    if (used <= 1u) {
        return; // written by the partition kernel
    }
    const size_t first = ((size_t)query * q_heads + head) * partitions;
    if (threadIdx.x < 32u) {
        const unsigned int lane = threadIdx.x;
        float top = -INFINITY;
        for (unsigned int p = lane; p < used; p += 32u) {
            top = fmaxf(top, part_max[first + p]);
        }
        top = warp_max(top);
        float sum = 0.0f;
        for (unsigned int p = lane; p < used; p += 32u) {
            const float e = exp2f(part_max[first + p] - top);
            weight[p] = e;
            sum += part_sum[first + p] * e;
        }
        sum = warp_sum(sum);
        if (lane == 0u) {
            total = sum;
        }
    }
    __syncthreads();
    const float inv = 1.0f / total;
    float* o = out + ((size_t)query * q_heads + head) * head_dim;
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int p = 0; p < used; ++p) {
            acc = fmaf(part_out[(first + p) * head_dim + d], weight[p], acc);
        }
        o[d] = acc * inv;
        if (out16 != 0) {
            out16[((size_t)query * q_heads + head) * head_dim + d] = f32_to_bf16(acc * inv);
        }
    }
}
