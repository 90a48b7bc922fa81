// Paged attention over a batch of query tokens, each reading its sequence's cached K/V
// (written by `kv_write_bf16` first). Decode (one query per sequence) and chunked prefill
// (every prompt token of a chunk, its context its position + 1: causal) are the same
// computation, so one kernel pair serves both.
//
// Split along the context (for long contexts): grid (q_heads, queries, partitions);
// partition p covers positions [lo + p·PART, min(lo + (p+1)·PART, context)) and writes its
// maximum logit, its sum of exponentials and its unnormalised output;
// `paged_attention_reduce` merges the partitions. lo is 0, or under a sliding window of
// `window` positions (0: none) the first of the last `window` (`window_start`). Cache
// layout: [blocks][block_size][kv_heads][head_dim], bf16 (`paged_attention_partition`) or
// f32 on the exact path (`paged_attention_partition_f32`). head_dim ≤ 256. Twin:
// `attention::paged_attention` over the CPU cache.

#define PART 256

template <typename T>
__device__ __forceinline__ void paged_attention_partition_of(
    float* part_out,
    float* part_max,
    float* part_sum,
    const float* q,
    const T* k_cache,
    const T* v_cache,
    const unsigned int* block_tables,
    const unsigned int* query_seq,
    const unsigned int* context_lens,
    unsigned int max_blocks,
    unsigned int block_size,
    unsigned int q_heads,
    unsigned int kv_heads,
    unsigned int head_dim,
    unsigned int partitions,
    unsigned int window,
    float scale) {
    __shared__ float logits[PART];
    __shared__ float qs[256];
    __shared__ float scratch[32];
    const unsigned int head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const unsigned int part = blockIdx.z;
    const size_t slot = ((size_t)query * q_heads + head) * partitions + part;
    const unsigned int context = context_lens[query];
    const unsigned int start = window_start(context, window) + part * PART;
    // Past this query's context: nothing to do (the reduce reads only the partitions a
    // context uses; a decode graph launches every partition of its longest context).
    if (start >= context) {
        return;
    }
    const unsigned int n = min(PART, context - start);
    const unsigned int kv_head = head / (q_heads / kv_heads);
    const unsigned int* table = block_tables + (size_t)query_seq[query] * max_blocks;
    const float* qh = q + ((size_t)query * q_heads + head) * head_dim;
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        qs[d] = qh[d] * scale;
    }
    __syncthreads();

    // One warp per position: q · k.
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warps = blockDim.x >> 5;
    for (unsigned int j = threadIdx.x >> 5; j < n; j += warps) {
        const unsigned int pos = start + j;
        const size_t row = (size_t)table[pos / block_size] * block_size + pos % block_size;
        const T* kp = k_cache + (row * kv_heads + kv_head) * head_dim;
        float dot = 0.0f;
        for (unsigned int d = lane; d < head_dim; d += 32) {
            dot += qs[d] * held_to_f32(kp[d]);
        }
        dot = warp_sum(dot);
        if (lane == 0) {
            logits[j] = dot;
        }
    }
    __syncthreads();

    float m = -INFINITY;
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
        m = fmaxf(m, logits[j]);
    }
    m = block_max(m, scratch);
    float s = 0.0f;
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = __expf(logits[j] - m);
        logits[j] = e;
        s += e;
    }
    s = block_sum(s, scratch);

    // One thread per output dimension: Σ exp · v.
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int j = 0; j < n; ++j) {
            const unsigned int pos = start + j;
            const size_t row = (size_t)table[pos / block_size] * block_size + pos % block_size;
            acc += logits[j] * held_to_f32(v_cache[(row * kv_heads + kv_head) * head_dim + d]);
        }
        part_out[slot * head_dim + d] = acc;
    }
    if (threadIdx.x == 0) {
        part_max[slot] = m;
        part_sum[slot] = s;
    }
}

// The entries' parameters over a cache of `T`, and the arguments that pass them on.
#define PARTITION_PARAMS(T)                                                                 \
    float *part_out, float *part_max, float *part_sum, const float *q, const T *k_cache,    \
        const T *v_cache, const unsigned int *block_tables, const unsigned int *query_seq, \
        const unsigned int *context_lens, unsigned int max_blocks, unsigned int block_size, \
        unsigned int q_heads, unsigned int kv_heads, unsigned int head_dim,                 \
        unsigned int partitions, unsigned int window, float scale
#define PARTITION_ARGS                                                                      \
    part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, query_seq,             \
        context_lens, max_blocks, block_size, q_heads, kv_heads, head_dim, partitions,      \
        window, scale

extern "C" __global__ void paged_attention_partition(PARTITION_PARAMS(bf16_t)) {
    paged_attention_partition_of<bf16_t>(PARTITION_ARGS);
}

extern "C" __global__ void paged_attention_partition_f32(PARTITION_PARAMS(float)) {
    paged_attention_partition_of<float>(PARTITION_ARGS);
}

// Merges the partitions of each (head, query): grid (q_heads, queries).
extern "C" __global__ void paged_attention_reduce(
    float* out,
    const float* part_out,
    const float* part_max,
    const float* part_sum,
    const unsigned int* context_lens,
    unsigned int q_heads,
    unsigned int head_dim,
    unsigned int partitions,
    unsigned int window) {
    const unsigned int head = blockIdx.x;
    const unsigned int query = blockIdx.y;
    const size_t first = ((size_t)query * q_heads + head) * partitions;
    const unsigned int context = context_lens[query];
    const unsigned int span = context - window_start(context, window);
    const unsigned int used = min(partitions, (span + PART - 1) / PART);
    float m = -INFINITY;
    for (unsigned int p = 0; p < used; ++p) {
        m = fmaxf(m, part_max[first + p]);
    }
    float s = 0.0f;
    for (unsigned int p = 0; p < used; ++p) {
        s += part_sum[first + p] * __expf(part_max[first + p] - m);
    }
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    float* o = out + ((size_t)query * q_heads + head) * head_dim;
    for (unsigned int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int p = 0; p < used; ++p) {
            acc += part_out[(first + p) * head_dim + d] * __expf(part_max[first + p] - m);
        }
        o[d] = acc * inv;
    }
}
