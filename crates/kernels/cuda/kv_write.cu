// Writes each token's K and V into its slot of the paged cache, one block per token.
// Cache layout per layer: [blocks][block_size][kv_heads][head_dim] in bf16; `slots[t]` is
// block × block_size + offset (negative: skip, a padding token). Twin: the CPU model's
// `KvCache` write.
extern "C" __global__ void kv_write_bf16(
    bf16_t* k_cache,
    bf16_t* v_cache,
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
        k_cache[dst + i] = f32_to_bf16(k[src + i]);
        v_cache[dst + i] = f32_to_bf16(v[src + i]);
    }
}
