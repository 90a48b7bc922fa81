// Writes each token's K and V into its slot of the paged cache, one block per token.
// Cache layout per layer: [blocks][block_size][kv_heads][head_dim], bf16 (`kv_write_bf16`)
// or f32 on the exact path (`kv_write_f32`); `slots[t]` is block × block_size + offset
// (negative: skip, a padding token). Twin: the CPU model's `KvCache` write.
template <typename T>
__device__ __forceinline__ void kv_write(
    T* k_cache,
    T* v_cache,
    const float* k,
    const float* v,
    const long long* slots,
    unsigned int kv_width) {
    const unsigned int t = blockIdx.x;
    const long long slot = slots[t];
    if (slot < 0) {
        return;
    }
    const size_t dst = (size_t)slot * kv_width;
    const size_t src = (size_t)t * kv_width;
    for (unsigned int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        store_held(k_cache + dst + i, k[src + i]);
        store_held(v_cache + dst + i, v[src + i]);
    }
}

// The entries' parameters over a cache of `T`, and the arguments that pass them on.
#define KV_WRITE_PARAMS(T)                                                                  \
    T *k_cache, T *v_cache, const float *k, const float *v, const long long *slots,         \
        unsigned int kv_width
#define KV_WRITE_ARGS k_cache, v_cache, k, v, slots, kv_width

extern "C" __global__ void kv_write_bf16(KV_WRITE_PARAMS(bf16_t)) {
    kv_write(KV_WRITE_ARGS);
}

extern "C" __global__ void kv_write_f32(KV_WRITE_PARAMS(float)) {
    kv_write(KV_WRITE_ARGS);
}
