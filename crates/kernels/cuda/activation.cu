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
