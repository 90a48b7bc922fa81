// Rotary position embedding of q and k in place, one block per token. `inv_freq` holds
// head_dim / 2 frequencies with any scaling (llama3, linear) already applied by the host
// (`rope::Rope::inv_freq`). Pairing 0: dimension i with i + head_dim/2 (HuggingFace
// rotate_half); 1: 2i with 2i + 1 (GGUF's permuted weights). Twin: `rope::Rope::apply`.
extern "C" __global__ void rope_f32(
    float* q,
    float* k,
    const unsigned int* positions,
    const float* inv_freq,
    unsigned int q_heads,
    unsigned int k_heads,
    unsigned int head_dim,
    unsigned int pairing) {
    const unsigned int t = blockIdx.x;
    const unsigned int half = head_dim / 2;
    const float pos = (float)positions[t];
    const unsigned int pairs = (q_heads + k_heads) * half;
    for (unsigned int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const unsigned int head = p / half;
        const unsigned int i = p % half;
        float* h = head < q_heads
            ? q + ((size_t)t * q_heads + head) * head_dim
            : k + ((size_t)t * k_heads + (head - q_heads)) * head_dim;
        const unsigned int a = pairing == 0 ? i : 2 * i;
        const unsigned int b = pairing == 0 ? i + half : 2 * i + 1;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float x = h[a];
        const float y = h[b];
        h[a] = x * c - y * s;
        h[b] = y * c + x * s;
    }
}
