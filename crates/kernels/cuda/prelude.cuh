// Prepended to every kernel file before NVRTC compiles it (`kernels::cuda::source`), so
// that each file is one self-contained kernel family that needs no CUDA header at run
// time: a host with the driver and libnvrtc is enough.
//
// Conventions: activations are f32; large weights and the KV cache are bf16, held as
// `unsigned short` (f32 on the exact path, see `held_to_f32`); GGML block scales are f16.
// Blocks of threads are a multiple of 32 and at most 1024 threads.

typedef unsigned short bf16_t;
typedef unsigned short f16_t;

// math.h's, which NVRTC does not include.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// A value a table holds (the embedding, the KV cache) as f32, and an f32 stored as one:
// bf16 bits on the default path, f32 itself on the exact one (`dtype = "f32"`). A kernel
// written once over `T` serves both.
__device__ __forceinline__ float held_to_f32(bf16_t v) {
    return bf16_to_f32(v);
}
__device__ __forceinline__ float held_to_f32(float v) {
    return v;
}
__device__ __forceinline__ void store_held(bf16_t* dst, float v) {
    *dst = f32_to_bf16(v);
}
__device__ __forceinline__ void store_held(float* dst, float v) {
    *dst = v;
}

// The 8 bf16 of `w` as floats (16-byte loads of bf16 rows; element 2i is the low half of word i).
__device__ __forceinline__ void unpack_bf16x8(uint4 w, float* f) {
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xffff0000u);
    f[4] = __uint_as_float(w.z << 16);
    f[5] = __uint_as_float(w.z & 0xffff0000u);
    f[6] = __uint_as_float(w.w << 16);
    f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// IEEE half to float, subnormals included (no cuda_fp16.h needed).
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int man = (unsigned int)h & 0x3ffu;
    if (exp == 0) {
        // Zero or subnormal: man × 2^-24.
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) {
        return __uint_as_float(sign | 0x7f800000u | (man << 13));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// The sum of `v` over the block, on every thread. `scratch`: 32 floats of shared memory,
// free on entry and on return.
__device__ float block_sum(float v, float* scratch) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = (blockDim.x + 31u) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    // Lane 0's sum on every thread: lanes of a butterfly add in different orders, and
    // threads that branch on the sum must agree on it to the bit.
    return __shfl_sync(0xffffffffu, warp_sum(v), 0);
}

// The maximum of `v` over the block, on every thread (see `block_sum`).
__device__ float block_max(float v, float* scratch) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = (blockDim.x + 31u) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// The first position a query that sees `context` positions attends to under a sliding
// window of `window` positions (0: none): the last `window`, its own included. Twin:
// `AttentionParams::span`.
__device__ __forceinline__ unsigned int window_start(unsigned int context, unsigned int window) {
    return (window != 0u && context > window) ? context - window : 0u;
}
