// RMSNorm fused with the residual add, one block per token:
//   residual += x            (when x is not null: the sublayer's output)
//   out = residual * rsqrt(mean(residual²) + eps) * weight
// Twin: `norm::rms_norm` after the residual add.
extern "C" __global__ void rmsnorm_residual_f32(
    float* out,
    float* residual,
    const float* x,
    const float* weight,
    unsigned int hidden,
    float eps) {
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * hidden;
    float* r = residual + base;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = r[i];
        if (x != 0) {
            v += x[base + i];
            r[i] = v;
        }
        squares += v * v;
    }
    const float total = block_sum(squares, scratch);
    const float scale = rsqrtf(total / (float)hidden + eps);
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[base + i] = r[i] * scale * weight[i];
    }
}
