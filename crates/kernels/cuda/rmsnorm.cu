// What both kernels take after `residual`, in the order `Ops::rmsnorm` (ops/fused.rs)
// pushes it: the sublayer's output (or null), the norm's weight, the row length and eps.
#define NORM_PARAMS const float* x, const float* weight, unsigned int hidden, float eps

// The residual add of one token's row `r` from `first` on, one value per thread in
// strides of the block: r[i] += x[base + i] when x is not null. Adds each result's square
// to this thread's `squares`, sums them over the block (in shared scratch) and returns the
// rms scale rsqrt(mean(r²) + eps).
__device__ __forceinline__ float add_residual_rms_scale(
    float* r,
    const float* x,
    size_t base,
    unsigned int first,
    unsigned int hidden,
    float eps,
    float squares) {
    __shared__ float scratch[32];
    for (unsigned int i = first + threadIdx.x; i < hidden; i += blockDim.x) {
        float v = r[i];
        if (x != 0) {
            v += x[base + i];
            r[i] = v;
        }
        squares += v * v;
    }
    const float total = block_sum(squares, scratch);
    return rsqrtf(total / (float)hidden + eps);
}

// RMSNorm fused with the residual add, one block per token:
//   residual += x            (when x is not null: the sublayer's output)
//   out = residual * rsqrt(mean(residual²) + eps) * weight
// Twin: `norm::rms_norm` after the residual add.
extern "C" __global__ void rmsnorm_residual_f32(
    float* out,
    float* residual,
    NORM_PARAMS) {
    const size_t base = (size_t)blockIdx.x * hidden;
    float* r = residual + base;
    const float scale = add_residual_rms_scale(r, x, base, 0u, hidden, eps, 0.0f);
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[base + i] = r[i] * scale * weight[i];
    }
}

// The same, writing the bf16 input of the next GEMM directly (and its f32 value only when
// `out32` is not null: a quantized matvec reads f32), with 16-byte loads and stores of the
// residual when `hidden` is a multiple of 4. Replaces rmsnorm_residual_f32 + round_bf16.
// Twin: `fused::add_rms_norm_bf16` (`norm::add_rms_norm`, then round to nearest even).
extern "C" __global__ void rmsnorm_residual_bf16(
    bf16_t* out16,
    float* out32,
    float* residual,
    NORM_PARAMS) {
    const size_t base = (size_t)blockIdx.x * hidden;
    float* r = residual + base;
    // Rows start 16-byte aligned when hidden is a multiple of 4 (cudaMalloc aligns 256).
    const unsigned int vec = (hidden & 3u) == 0u ? hidden / 4u : 0u;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < vec; i += blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(r)[i];
        if (x != 0) {
            const float4 a = reinterpret_cast<const float4*>(x + base)[i];
            v.x += a.x;
            v.y += a.y;
            v.z += a.z;
            v.w += a.w;
            reinterpret_cast<float4*>(r)[i] = v;
        }
        squares += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float scale = add_residual_rms_scale(r, x, base, 4u * vec, hidden, eps, squares);
    for (unsigned int i = threadIdx.x; i < vec; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(r)[i];
        const float4 w = reinterpret_cast<const float4*>(weight)[i];
        const float4 o = make_float4(v.x * scale * w.x, v.y * scale * w.y,
                                     v.z * scale * w.z, v.w * scale * w.w);
        uint2 packed;
        packed.x = (unsigned int)f32_to_bf16(o.x) | ((unsigned int)f32_to_bf16(o.y) << 16);
        packed.y = (unsigned int)f32_to_bf16(o.z) | ((unsigned int)f32_to_bf16(o.w) << 16);
        reinterpret_cast<uint2*>(out16 + base)[i] = packed;
        if (out32 != 0) {
            reinterpret_cast<float4*>(out32 + base)[i] = o;
        }
    }
    for (unsigned int i = 4u * vec + threadIdx.x; i < hidden; i += blockDim.x) {
        const float o = r[i] * scale * weight[i];
        out16[base + i] = f32_to_bf16(o);
        if (out32 != 0) {
            out32[base + i] = o;
        }
    }
}
