// bf16 matrix × a few vectors, for the small batches of decode (1 to 8 tokens), where a
// projection is bound by reading its weights once: ys[t, r] = Σ_c W[r, c] · xs[t, c], the
// semantics and layouts of `Blas::gemm_bf16` (W rows × cols and xs tokens × cols, bf16
// bits, row-major; ys tokens × rows f32; products and sums in f32). Twin: the bf16 → f32
// products summed in f32 (`tests/gemv_case/`), and cuBLAS on the same inputs.
//
// One entry per token count T (`gemv_bf16_t1` … `gemv_bf16_t8`), so that each weight byte
// is read once for every token of the batch and the T × GEMV_ROWS sums live in registers.
// A block of GEMV_WARPS warps takes GEMV_ROWS consecutive rows (grid: ceil(rows /
// GEMV_ROWS)) and splits their columns among its threads, so that even a projection of a
// few hundred rows spreads over every multiprocessor and each thread has few steps. A
// thread reads 8 columns at a time with one 16-byte load per row (when cols % 8 == 0 and
// both matrices start 16-byte aligned; otherwise every column goes through the 2-byte
// path), GEMV_UNROLL such steps per iteration so that several loads are in flight. The
// weights are streamed past L1 (`ld.global.nc.L1::no_allocate`: each byte is read once),
// which leaves L1 to the activations, read by every block of the multiprocessor
// (`ld.global.nc`). The sums meet by warp shuffles, then across the warps in shared
// memory. Mirrored by `GEMV_*` in `ops/gemv.rs`.

#define GEMV_WARPS 4
#define GEMV_ROWS 2
#define GEMV_UNROLL 2

#ifndef TESSERA_EMULATE
// 16 bytes of weights, streamed: read-only, not kept in L1.
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// 16 bytes of activations through the read-only (L1) path: every warp reads them.
__device__ __forceinline__ uint4 load_activations(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
#else
// The CPU emulation (crates/kernels/tests/emu) has no PTX: plain loads, the same values.
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
    return *p;
}
__device__ __forceinline__ uint4 load_activations(const uint4* p) {
    return *p;
}
#endif

template <int T>
__device__ __forceinline__ void gemv_bf16(
    float* __restrict__ ys,
    const bf16_t* __restrict__ w,
    const bf16_t* __restrict__ xs,
    unsigned int rows,
    unsigned int cols) {
    __shared__ float partial[GEMV_WARPS][T][GEMV_ROWS];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int first = blockIdx.x * GEMV_ROWS;
    if (first >= rows) {
        return; // the whole block (a launch over no rows has one block)
    }
    // A block's last rows past the matrix read its last row again, and are not written.
    const bf16_t* row[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        row[r] = w + (size_t)min(first + r, rows - 1u) * cols;
    }
    float acc[T][GEMV_ROWS];
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            acc[t][r] = 0.0f;
        }
    }
    // Rows start 16-byte aligned when cols % 8 == 0 and the buffers do (cudaMalloc aligns
    // 256; the host may pass a view).
    const bool aligned = (cols & 7u) == 0u && ((((size_t)w) | ((size_t)xs)) & 15u) == 0u;
    const unsigned int chunks = aligned ? cols / 8u : 0u;
    const unsigned int stride = GEMV_WARPS * 32u;
    for (unsigned int base = threadIdx.x; base < chunks; base += stride * GEMV_UNROLL) {
        // Every load of the iteration first, so that they are in flight together.
        uint4 wv[GEMV_UNROLL][GEMV_ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const unsigned int c = base + stride * u;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                wv[u][r] = c < chunks ? load_weights(reinterpret_cast<const uint4*>(row[r]) + c)
                                      : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const unsigned int c = base + stride * u;
            if (c >= chunks) {
                break;
            }
            float wf[GEMV_ROWS][8];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                unpack_bf16x8(wv[u][r], wf[r]);
            }
#pragma unroll
            for (int t = 0; t < T; ++t) {
                float xf[8];
                unpack_bf16x8(
                    load_activations(reinterpret_cast<const uint4*>(xs + (size_t)t * cols) + c),
                    xf);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        acc[t][r] = fmaf(wf[r][i], xf[i], acc[t][r]);
                    }
                }
            }
        }
    }
    // The columns the 16-byte path did not take (all of them when it was off).
    for (unsigned int c = chunks * 8u + threadIdx.x; c < cols; c += stride) {
        float wf[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            wf[r] = bf16_to_f32(row[r][c]);
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float x = bf16_to_f32(xs[(size_t)t * cols + c]);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                acc[t][r] = fmaf(wf[r], x, acc[t][r]);
            }
        }
    }
    // Each warp's sums (every lane ends with them: a butterfly), then the warps' in
    // shared memory: thread t · GEMV_ROWS + r of the first warp adds and writes one.
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const float sum = warp_sum(acc[t][r]);
            if (lane == 0u) {
                partial[warp][t][r] = sum;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < (unsigned int)(T * GEMV_ROWS)) {
        const unsigned int t = threadIdx.x / GEMV_ROWS;
        const unsigned int r = threadIdx.x % GEMV_ROWS;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < GEMV_WARPS; ++k) {
            sum += partial[k][t][r];
        }
        if (first + r < rows) {
            ys[(size_t)t * rows + first + r] = sum;
        }
    }
}

#define GEMV_PARAMS                                                                         \
    float *ys, const bf16_t *w, const bf16_t *xs, unsigned int rows, unsigned int cols

extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t1(GEMV_PARAMS) {
    gemv_bf16<1>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t2(GEMV_PARAMS) {
    gemv_bf16<2>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t3(GEMV_PARAMS) {
    gemv_bf16<3>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t4(GEMV_PARAMS) {
    gemv_bf16<4>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t5(GEMV_PARAMS) {
    gemv_bf16<5>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t6(GEMV_PARAMS) {
    gemv_bf16<6>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t7(GEMV_PARAMS) {
    gemv_bf16<7>(ys, w, xs, rows, cols);
}
extern "C" __global__ __launch_bounds__(128) void gemv_bf16_t8(GEMV_PARAMS) {
    gemv_bf16<8>(ys, w, xs, rows, cols);
}
