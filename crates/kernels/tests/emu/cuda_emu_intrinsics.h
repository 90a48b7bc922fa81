// cuda_emu_intrinsics.h: the CUDA intrinsics of the CPU emulation, on top of the
// scheduler in cuda_emu.h (which includes this file at its end; do not include it alone).

#pragma once

// ---------------------------------------------------------------------------------------
// Synchronisation and warp collectives.

inline void __syncthreads() { emu::block_sync(); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) { emu::warp_sync(mask, "__syncwarp"); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
    return emu::shuffle(
        mask, var,
        [=](unsigned int lane) {
            return (lane & ~(unsigned int)(width - 1)) + ((unsigned int)src_lane & (width - 1));
        },
        "__shfl_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
    return emu::shuffle(
        mask, var,
        [=](unsigned int lane) {
            const unsigned int src = lane ^ (unsigned int)lane_mask;
            // A source in a later group of `width` lanes: the caller's own value.
            return src >= ((lane & ~(unsigned int)(width - 1)) + width) ? lane : src & 31u;
        },
        "__shfl_xor_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    return emu::shuffle(
        mask, var,
        [=](unsigned int lane) {
            const unsigned int src = lane + delta;
            return src >= ((lane & ~(unsigned int)(width - 1)) + width) ? lane : src;
        },
        "__shfl_down_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
    return emu::shuffle(
        mask, var,
        [=](unsigned int lane) {
            const unsigned int base = lane & ~(unsigned int)(width - 1);
            return lane < base + delta ? lane : lane - delta;
        },
        "__shfl_up_sync");
}
inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
    return emu::warp_reduce(
        mask, predicate != 0 ? 1u : 0u,
        [](unsigned int l, unsigned int v, unsigned int acc, bool) { return acc | (v << l); },
        "__ballot_sync");
}
inline int __any_sync(unsigned int mask, int predicate) {
    return __ballot_sync(mask, predicate) != 0;
}
inline int __all_sync(unsigned int mask, int predicate) {
    return __ballot_sync(mask, predicate) == mask;
}

// ---------------------------------------------------------------------------------------
// The tensor-core op of the kernels: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32,
// D = A·B + C with A 16×16 (row-major), B 16×8 ("col": stored K-major per column), C and D
// 16×8 f32, collective over all 32 lanes of the warp.
//
// Fragment layouts, from the PTX ISA, section 9.7.15.5.8 (9.7.14.5.8 in older versions)
// "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16/.bf16 A and B, .f32
// C/D). With groupID g = laneid >> 2 and threadID_in_group t = laneid % 4, a lane holds
// elements a0..a7 of A, b0..b3 of B, c0..c3 of C/D, where
//   A: row(a_i) = g for i in {0,1,4,5}, g + 8 for i in {2,3,6,7};
//      col(a_i) = 2t + (i & 1) for i < 4, 2t + (i & 1) + 8 for i >= 4;
//   B: row(b_i) = 2t + (i & 1) for i < 2, 2t + (i & 1) + 8 for i >= 2; col(b_i) = g;
//   C/D: row(c_i) = g for i < 2, g + 8 for i >= 2; col(c_i) = 2t + (i & 1).
// The A and B registers are .f16x2/.bf16x2 pairs listed "low to high": register r holds
// element 2r in bits 0..15 (the low half) and element 2r + 1 in bits 16..31. So:
//   a[0] = { lo: A[g][2t],       hi: A[g][2t+1]     }
//   a[1] = { lo: A[g+8][2t],     hi: A[g+8][2t+1]   }
//   a[2] = { lo: A[g][2t+8],     hi: A[g][2t+9]     }
//   a[3] = { lo: A[g+8][2t+8],   hi: A[g+8][2t+9]   }
//   b[0] = { lo: B[2t][g],       hi: B[2t+1][g]     }
//   b[1] = { lo: B[2t+8][g],     hi: B[2t+9][g]     }
//   d[0] = D[g][2t], d[1] = D[g][2t+1], d[2] = D[g+8][2t], d[3] = D[g+8][2t+1]
// (the lower-index element of a pair, column for A, row for B, is the low half).
//
// Arithmetic: bf16 → f32 is exact and so is every bf16·bf16 product in f32; each output
// is c, then the 16 products added in k order 0..15, each sum rounded to f32 (fmaf of an
// exact product = a rounded add). The tensor core adds in its own order and precision,
// so a GPU result can differ in the last bits where sums cancel or round.
inline void mma_m16n8k16_bf16(float d[4], const unsigned int a[4], const unsigned int b[2]) {
    emu::Warp& w = emu::my_warp();
    const unsigned int lane = emu::my_lane();
    for (int r = 0; r < 4; ++r) {
        w.mma_a[lane][r] = a[r];
    }
    w.mma_b[lane][0] = b[0];
    w.mma_b[lane][1] = b[1];
    emu::warp_sync(0xffffffffu, "mma_m16n8k16_bf16 (needs all 32 lanes)");
    float A[16][16];
    float B[16][8];
    for (unsigned int l = 0; l < 32; ++l) {
        const unsigned int g = l >> 2;
        const unsigned int t = l & 3u;
        const unsigned int* ra = w.mma_a[l];
        A[g][2 * t] = emu::bf16_lo(ra[0]);
        A[g][2 * t + 1] = emu::bf16_hi(ra[0]);
        A[g + 8][2 * t] = emu::bf16_lo(ra[1]);
        A[g + 8][2 * t + 1] = emu::bf16_hi(ra[1]);
        A[g][2 * t + 8] = emu::bf16_lo(ra[2]);
        A[g][2 * t + 9] = emu::bf16_hi(ra[2]);
        A[g + 8][2 * t + 8] = emu::bf16_lo(ra[3]);
        A[g + 8][2 * t + 9] = emu::bf16_hi(ra[3]);
        const unsigned int* rb = w.mma_b[l];
        B[2 * t][g] = emu::bf16_lo(rb[0]);
        B[2 * t + 1][g] = emu::bf16_hi(rb[0]);
        B[2 * t + 8][g] = emu::bf16_lo(rb[1]);
        B[2 * t + 9][g] = emu::bf16_hi(rb[1]);
    }
    emu::warp_sync(0xffffffffu, "mma_m16n8k16_bf16 (needs all 32 lanes)");
    const unsigned int g = lane >> 2;
    const unsigned int t = lane & 3u;
    for (int i = 0; i < 4; ++i) {
        const unsigned int row = g + (i >= 2 ? 8u : 0u);
        const unsigned int col = 2 * t + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) {
            acc = fmaf(A[row][k], B[k][col], acc);
        }
        d[i] = acc;
    }
}

// ---------------------------------------------------------------------------------------
// Bits, integer and float intrinsics.

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return std::bit_cast<unsigned int>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// Explicitly rounded f32/f64 ops: the empty asm keeps g++ from fusing them into an fma.
#define EMU_NOFUSE(v) asm("" : "+x"(v))
inline float __fadd_rn(float a, float b) { float r = a + b; EMU_NOFUSE(r); return r; }
inline float __fsub_rn(float a, float b) { float r = a - b; EMU_NOFUSE(r); return r; }
inline float __fmul_rn(float a, float b) { float r = a * b; EMU_NOFUSE(r); return r; }
inline float __fdiv_rn(float a, float b) { float r = a / b; EMU_NOFUSE(r); return r; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { float r = 1.0f / a; EMU_NOFUSE(r); return r; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline double __dadd_rn(double a, double b) { double r = a + b; EMU_NOFUSE(r); return r; }
inline double __dsub_rn(double a, double b) { double r = a - b; EMU_NOFUSE(r); return r; }
inline double __dmul_rn(double a, double b) { double r = a * b; EMU_NOFUSE(r); return r; }
inline double __ddiv_rn(double a, double b) { double r = a / b; EMU_NOFUSE(r); return r; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

// Fast-math intrinsics: libm's accurate versions (the GPU's are approximations).
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned int __float2uint_rn(float x) { return (unsigned int)nearbyintf(x); }
inline unsigned int __float2uint_rz(float x) { return (unsigned int)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned int x) { return (float)x; }

template <class T>
inline T __ldg(const T* p) { return *p; }

// CUDA's min/max: any two arithmetic types, in their common type (so min(int, unsigned)
// is unsigned, as in CUDA); floats as fminf/fmaxf (a NaN loses to a number).
template <class A, class B>
    requires(std::is_arithmetic_v<A> && std::is_arithmetic_v<B>)
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmin((C)a, (C)b);
    } else {
        return (C)b < (C)a ? (C)b : (C)a;
    }
}
template <class A, class B>
    requires(std::is_arithmetic_v<A> && std::is_arithmetic_v<B>)
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) {
        return std::fmax((C)a, (C)b);
    } else {
        return (C)a < (C)b ? (C)b : (C)a;
    }
}
inline unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int umax(unsigned int a, unsigned int b) { return a < b ? b : a; }

// ---------------------------------------------------------------------------------------
// Atomics: one fiber runs at a time and none switches inside these, so plain
// read-modify-writes are atomic.

template <class T>
inline T atomicAdd(T* p, std::type_identity_t<T> v) { T old = *p; *p = old + v; return old; }
template <class T>
inline T atomicSub(T* p, std::type_identity_t<T> v) { T old = *p; *p = old - v; return old; }
template <class T>
inline T atomicExch(T* p, std::type_identity_t<T> v) { T old = *p; *p = v; return old; }
template <class T>
inline T atomicMin(T* p, std::type_identity_t<T> v) { T old = *p; *p = v < old ? v : old; return old; }
template <class T>
inline T atomicMax(T* p, std::type_identity_t<T> v) { T old = *p; *p = old < v ? v : old; return old; }
template <class T>
inline T atomicAnd(T* p, std::type_identity_t<T> v) { T old = *p; *p = old & v; return old; }
template <class T>
inline T atomicOr(T* p, std::type_identity_t<T> v) { T old = *p; *p = old | v; return old; }
template <class T>
inline T atomicXor(T* p, std::type_identity_t<T> v) { T old = *p; *p = old ^ v; return old; }
template <class T>
inline T atomicCAS(T* p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
    T old = *p;
    if (old == compare) {
        *p = v;
    }
    return old;
}
inline unsigned int atomicInc(unsigned int* p, unsigned int limit) {
    unsigned int old = *p;
    *p = old >= limit ? 0u : old + 1u;
    return old;
}

inline void __trap() { emu::fail("__trap()"); }
inline long long clock64() { return 0; }
inline unsigned int __activemask() = delete; // not emulated: the active set is not tracked
