// SwiGLU: out[t, i] = silu(gate[t, i]) * up[t, i], gate and up rows `stride` apart in
// their buffers (one fused gate|up projection: stride = 2 × inter, up = gate + inter).
// Twin: `activation::silu_mul`.
extern "C" __global__ void silu_mul_f32(
    float* out,
    const float* gate,
    const float* up,
    unsigned int inter,
    unsigned int stride,
    unsigned int tokens) {
    const size_t n = (size_t)inter * tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / inter;
        const size_t i = j % inter;
        const float g = gate[t * stride + i];
        const float u = up[t * stride + i];
        out[j] = g / (1.0f + __expf(-g)) * u;
    }
}

// SwiGLU over the fused gate|up projection (rows of 2 × inter: gate, then up), writing
// the bf16 input of the down projection directly (and its f32 value only when `out32` is
// not null: a quantized matvec reads f32). Four values per thread, 16-byte loads, when
// inter is a multiple of 4. Replaces silu_mul_f32 + round_bf16.
// Twin: `fused::silu_mul_bf16` (`activation::silu_mul`, then round to nearest even).
extern "C" __global__ void silu_mul_bf16(
    bf16_t* out16,
    float* out32,
    const float* gate_up,
    unsigned int inter,
    unsigned int tokens) {
    const unsigned int width = (inter & 3u) == 0u ? 4u : 1u;
    const unsigned int per_row = inter / width;
    const size_t n = (size_t)per_row * tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / per_row;
        const size_t i = (j % per_row) * width;
        const float* g = gate_up + t * 2 * inter + i;
        const float* u = g + inter;
        const size_t at = t * inter + i;
        float gv[4];
        float uv[4];
        if (width == 4u) {
            const float4 a = *reinterpret_cast<const float4*>(g);
            const float4 b = *reinterpret_cast<const float4*>(u);
            gv[0] = a.x; gv[1] = a.y; gv[2] = a.z; gv[3] = a.w;
            uv[0] = b.x; uv[1] = b.y; uv[2] = b.z; uv[3] = b.w;
        } else {
            gv[0] = g[0];
            uv[0] = u[0];
        }
        for (unsigned int e = 0; e < width; ++e) {
            const float o = gv[e] / (1.0f + __expf(-gv[e])) * uv[e];
            out16[at + e] = f32_to_bf16(o);
            if (out32 != 0) {
                out32[at + e] = o;
            }
        }
    }
}
