// Embedding gather: one block per token. A rank holds rows `vocab_start ..
// vocab_start + rows` of the table (bf16, or f32 on the exact path); a token outside them
// gives a zero row, so the ranks' rows sum (all-reduce) to the embedding. Twin: the CPU
// model's embedding lookup.
template <typename T>
__device__ __forceinline__ void embedding_gather(
    float* out,
    const T* table,
    const unsigned int* ids,
    unsigned int hidden,
    unsigned int vocab_start,
    unsigned int rows) {
    const unsigned int t = blockIdx.x;
    float* row = out + (size_t)t * hidden;
    const unsigned int id = ids[t];
    if (id < vocab_start || id - vocab_start >= rows) {
        for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
            row[i] = 0.0f;
        }
        return;
    }
    const T* src = table + (size_t)(id - vocab_start) * hidden;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        row[i] = held_to_f32(src[i]);
    }
}

// The entries' parameters over a table of `T`, and the arguments that pass them on.
#define GATHER_PARAMS(T)                                                                    \
    float *out, const T *table, const unsigned int *ids, unsigned int hidden,               \
        unsigned int vocab_start, unsigned int rows
#define GATHER_ARGS out, table, ids, hidden, vocab_start, rows

extern "C" __global__ void embedding_gather_bf16(GATHER_PARAMS(bf16_t)) {
    embedding_gather(GATHER_ARGS);
}

extern "C" __global__ void embedding_gather_f32(GATHER_PARAMS(float)) {
    embedding_gather(GATHER_ARGS);
}
