// Dequantizing matrix × vectors for block-quantized weights (GGML's, and FP8), for the
// small batches of decode: out[t, r] = Σ_c W[r, c] · x[t, c]. One warp per (row, token):
// grid (ceil(rows / warps per block), tokens). Twins: `matmul` with the `quant` dot
// products.

// Every entry's parameters: out (f32, tokens × rows), the rows' blocks, x (f32, tokens ×
// cols), and the shape; and the arguments that pass them on.
#define MATVEC_PARAMS                                                                       \
    float *out, const unsigned char *w, const float *x, unsigned int rows, unsigned int cols
#define MATVEC_ARGS out, w, x, rows, cols

__device__ __forceinline__ float load_f16(const unsigned char* p) {
    return f16_to_f32((f16_t)(p[0] | (p[1] << 8)));
}

// This warp's output row (blockIdx.x × warps + warp) and token (blockIdx.y).
__device__ __forceinline__ unsigned int warp_row() {
    return blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
}

// Sums the lanes' partial dot products into out[token, row].
__device__ __forceinline__ void store_row(float* out, unsigned int rows, unsigned int row, float acc) {
    acc = warp_sum(acc);
    if ((threadIdx.x & 31u) == 0) {
        out[(size_t)blockIdx.y * rows + row] = acc;
    }
}

// The matvec of a type whose blocks hold 32 values in BYTES bytes: each lane takes every
// 32nd block of the row and adds scale(block) · Σ_i value(block, i) · x[i] over it.
// cols % 32 == 0.
template <unsigned int BYTES, typename Scale, typename Value>
__device__ __forceinline__ void matvec_blocks32(
    float* out,
    const unsigned char* w,
    const float* x,
    unsigned int rows,
    unsigned int cols,
    Scale scale,
    Value value) {
    const unsigned int row = warp_row();
    if (row >= rows) {
        return;
    }
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int blocks = cols / 32;
    const unsigned char* wr = w + (size_t)row * blocks * BYTES;
    const float* xt = x + (size_t)blockIdx.y * cols;
    float acc = 0.0f;
    for (unsigned int b = lane; b < blocks; b += 32) {
        const unsigned char* blk = wr + (size_t)b * BYTES;
        const float* xb = xt + b * 32;
        float dot = 0.0f;
        for (unsigned int i = 0; i < 32; ++i) {
            dot += value(blk, i) * xb[i];
        }
        acc += scale(blk) * dot;
    }
    store_row(out, rows, row, acc);
}

// Q8_0: blocks of 32 values, 34 bytes: f16 scale d, then 32 signed quants. cols % 32 == 0.
extern "C" __global__ void matvec_q8_0(MATVEC_PARAMS) {
    matvec_blocks32<34>(
        out, w, x, rows, cols,
        [](const unsigned char* blk) { return load_f16(blk); },
        [](const unsigned char* blk, unsigned int i) { return (float)(signed char)blk[2 + i]; });
}

// Q5_0: blocks of 32 values, 22 bytes: f16 scale d, 32 fifth bits (a little-endian word,
// bit i for value i), then 16 bytes of nibbles (value i in the low nibble of byte i, value
// i + 16 in the high one); value = d · (q − 16). cols % 32 == 0.
extern "C" __global__ void matvec_q5_0(MATVEC_PARAMS) {
    matvec_blocks32<22>(
        out, w, x, rows, cols,
        [](const unsigned char* blk) { return load_f16(blk); },
        [](const unsigned char* blk, unsigned int i) {
            const unsigned int nibble = i < 16 ? blk[6 + i] & 0x0fu : blk[6 + i - 16] >> 4;
            const unsigned int fifth = (blk[2 + i / 8] >> (i % 8)) & 1u;
            return (float)(int)((nibble | (fifth << 4)) - 16u);
        });
}

// An e4m3fn code's value · 2^-8: moved into f16's layout (sign to bit 15, exponent and
// mantissa up 7 bits) it reads as that exactly, subnormals included, f16's exponent bias
// being 15 where e4m3fn's is 7; a NaN code (S.1111.111) becomes an f16 NaN. Twin:
// `quant::fp8::E4M3` (and the AVX2 kernel's `e4m3_as_f16`).
__device__ __forceinline__ float e4m3_scaled(unsigned int q) {
    unsigned int bits = ((q & 0x80u) << 8) | ((q & 0x7fu) << 7);
    if ((q & 0x7fu) == 0x7fu) {
        bits |= 0x7c00u;
    }
    return f16_to_f32((f16_t)bits);
}

// FP8 (Tessera's F8E4M3): blocks of 32 values, 36 bytes: f32 scale s (the checkpoint's
// tensor or row scale), then 32 e4m3fn codes. value = s · e4m3(q). cols % 32 == 0. Blocks
// are 36 bytes from the allocation's start, so each scale is 4-byte aligned; it carries
// the 2^8 that `e4m3_scaled` takes off.
extern "C" __global__ void matvec_f8_e4m3(MATVEC_PARAMS) {
    matvec_blocks32<36>(
        out, w, x, rows, cols,
        [](const unsigned char* blk) { return *(const float*)blk * 256.0f; },
        [](const unsigned char* blk, unsigned int i) { return e4m3_scaled(blk[4 + i]); });
}

// The 6-bit scale and minimum of Q4_K sub-block j (0..8) from the 12 packed bytes.
__device__ __forceinline__ void q4_k_scale_min(
    unsigned int j, const unsigned char* s, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Q4_K and Q5_K: super-blocks of 256 values, f16 d, f16 dmin, 12 bytes of 6-bit scales and
// minimums, then (Q5_K) 32 bytes of fifth bits `qh`, and 128 bytes of 4-bit quants (each
// 32-byte chunk c: 32 values in the low nibbles, the next 32 in the high ones, sub-blocks
// 2c and 2c + 1; Q5_K's fifth bit of value l of sub-block j is bit j of qh[l]). Value =
// d·sc·q − dmin·m. Each lane takes 4 low and 4 high values of a super-block.
// cols % 256 == 0.
template <unsigned int BYTES, bool FIVE>
__device__ __forceinline__ void matvec_k_scale_min(
    float* out,
    const unsigned char* w,
    const float* x,
    unsigned int rows,
    unsigned int cols) {
    const unsigned int row = warp_row();
    if (row >= rows) {
        return;
    }
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int supers = cols / 256;
    const unsigned char* wr = w + (size_t)row * supers * BYTES;
    const float* xt = x + (size_t)blockIdx.y * cols;
    const unsigned int chunk = lane / 8;
    const unsigned int l0 = (lane % 8) * 4;
    float acc = 0.0f;
    for (unsigned int b = 0; b < supers; ++b) {
        const unsigned char* blk = wr + (size_t)b * BYTES;
        const float d = load_f16(blk);
        const float dmin = load_f16(blk + 2);
        float sc_lo, m_lo, sc_hi, m_hi;
        q4_k_scale_min(2 * chunk, blk + 4, &sc_lo, &m_lo);
        q4_k_scale_min(2 * chunk + 1, blk + 4, &sc_hi, &m_hi);
        const unsigned char* qs = blk + (FIVE ? 48 : 16) + chunk * 32;
        const unsigned char* qh = blk + 16;
        const float* xl = xt + b * 256 + chunk * 64;
        float lo = 0.0f, lo_x = 0.0f, hi = 0.0f, hi_x = 0.0f;
        for (unsigned int l = l0; l < l0 + 4; ++l) {
            const float a = xl[l];
            const float c = xl[l + 32];
            unsigned int q_lo = qs[l] & 0x0fu;
            unsigned int q_hi = qs[l] >> 4;
            if (FIVE) {
                q_lo |= ((qh[l] >> (2 * chunk)) & 1u) << 4;
                q_hi |= ((qh[l] >> (2 * chunk + 1)) & 1u) << 4;
            }
            lo += (float)q_lo * a;
            lo_x += a;
            hi += (float)q_hi * c;
            hi_x += c;
        }
        acc += d * sc_lo * lo - dmin * m_lo * lo_x + d * sc_hi * hi - dmin * m_hi * hi_x;
    }
    store_row(out, rows, row, acc);
}

extern "C" __global__ void matvec_q4_k(MATVEC_PARAMS) {
    matvec_k_scale_min<144, false>(MATVEC_ARGS);
}

extern "C" __global__ void matvec_q5_k(MATVEC_PARAMS) {
    matvec_k_scale_min<176, true>(MATVEC_ARGS);
}

// Q6_K: super-blocks of 256 values, 210 bytes: 128 bytes of low nibbles `ql`, 64 bytes of
// high bit pairs `qh`, 16 signed 8-bit scales of 16-value sub-blocks, f16 d; value =
// d·sc·(q − 32). In half h (values 128h..128h + 128) lane l takes values 128h + l + 32k
// (k 0..4): the low nibble of ql[64h + l] (k 0) or of ql[64h + 32 + l] (k 1), their high
// nibbles (k 2, 3), above each bits 2k.. of qh[32h + l]; scale sc[8h + l/16 + 2k].
// cols % 256 == 0.
extern "C" __global__ void matvec_q6_k(MATVEC_PARAMS) {
    const unsigned int row = warp_row();
    if (row >= rows) {
        return;
    }
    const unsigned int l = threadIdx.x & 31u;
    const unsigned int supers = cols / 256;
    const unsigned char* wr = w + (size_t)row * supers * 210;
    const float* xt = x + (size_t)blockIdx.y * cols;
    float acc = 0.0f;
    for (unsigned int b = 0; b < supers; ++b) {
        const unsigned char* blk = wr + (size_t)b * 210;
        const float d = load_f16(blk + 208);
        const signed char* sc = (const signed char*)(blk + 192);
        const float* xb = xt + b * 256;
        float sum = 0.0f;
        for (unsigned int h = 0; h < 2; ++h) {
            const unsigned char* ql = blk + 64 * h;
            const unsigned int qh = blk[128 + 32 * h + l];
            const unsigned int lows[4] = {
                ql[l] & 0x0fu, ql[32 + l] & 0x0fu, (unsigned int)ql[l] >> 4,
                (unsigned int)ql[32 + l] >> 4};
            for (unsigned int k = 0; k < 4; ++k) {
                const int q = (int)(lows[k] | (((qh >> (2 * k)) & 3u) << 4)) - 32;
                const float s = (float)sc[8 * h + l / 16 + 2 * k];
                sum += s * (float)q * xb[128 * h + 32 * k + l];
            }
        }
        acc += d * sum;
    }
    store_row(out, rows, row, acc);
}
