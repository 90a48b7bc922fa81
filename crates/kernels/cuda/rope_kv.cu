// RoPE fused with the KV write, one block per token, over the stacked q|k|v projection
// (each token's row: q_heads, then kv_heads of k, then kv_heads of v, head_dim each):
//   q_out = rope(q + bias_q)                         (f32, the attention kernel's query)
//   k_cache[slot] = bf16(rope(k + bias_k)), v_cache[slot] = bf16(v + bias_v)
// `bias` may be null (Qwen2's q/k/v biases otherwise). `slots[t]` < 0: a padding token,
// whose K and V are not written. Pairing and `inv_freq` as in `rope_f32`; the cache
// layout is `kv_write_bf16`'s. Replaces add_bias_f32 (× 3), rope_f32 and kv_write_bf16.
// Twin: `fused::rope_kv_write` (the bias add, `rope::Rope::apply`, the bf16 write).
extern "C" __global__ void rope_kv_write(
    float* q_out,
    bf16_t* k_cache,
    bf16_t* v_cache,
    const float* qkv,
    const float* bias,
    const unsigned int* positions,
    const float* inv_freq,
    const long long* slots,
    unsigned int q_heads,
    unsigned int kv_heads,
    unsigned int head_dim,
    unsigned int pairing) {
    const unsigned int t = blockIdx.x;
    const unsigned int half = head_dim / 2;
    const unsigned int q_width = q_heads * head_dim;
    const unsigned int kv_width = kv_heads * head_dim;
    const float* row = qkv + (size_t)t * (q_width + 2u * kv_width);
    const long long slot = slots[t];
    const float pos = (float)positions[t];
    // Rotated pairs: the q heads', then the k heads'.
    const unsigned int pairs = (q_heads + kv_heads) * half;
    for (unsigned int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const unsigned int head = p / half;
        const unsigned int i = p % half;
        const unsigned int a = head * head_dim + (pairing == 0 ? i : 2 * i);
        const unsigned int b = head * head_dim + (pairing == 0 ? i + half : 2 * i + 1);
        float x = row[a];
        float y = row[b];
        if (bias != 0) {
            x += bias[a];
            y += bias[b];
        }
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float xr = x * c - y * s;
        const float yr = y * c + x * s;
        if (head < q_heads) {
            float* q = q_out + (size_t)t * q_width;
            q[a] = xr;
            q[b] = yr;
        } else if (slot >= 0) {
            bf16_t* k = k_cache + (size_t)slot * kv_width;
            k[a - q_width] = f32_to_bf16(xr);
            k[b - q_width] = f32_to_bf16(yr);
        }
    }
    if (slot < 0) {
        return;
    }
    bf16_t* v = v_cache + (size_t)slot * kv_width;
    const unsigned int v_at = q_width + kv_width;
    for (unsigned int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        float value = row[v_at + i];
        if (bias != 0) {
            value += bias[v_at + i];
        }
        v[i] = f32_to_bf16(value);
    }
}
