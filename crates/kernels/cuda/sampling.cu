// Sampling, one block of 1024 threads per row of logits: the rule of the host's sampler,
// `cpu::sample_threshold` (its twin), to the bit.
// - Greedy (temperature ≤ 0 or NaN, or no finite maximum): the first index of the maximum.
// - Else, with x_i = l_i / T, tokens go in order of x, largest first (lower index first on
//   ties), each weighing w_i = e^(x_i − max x) (`sampling_exp`), summed as the integers
//   ⌊w_i · 2^40⌋ so that every sum is exact in any order. Top-k keeps the x at least the
//   k-th largest; top-p the shortest head (whole groups of one x) reaching ⌊top_p · W_k⌋;
//   min-p drops w_i < min_p; the token is the first at which the kept weight summed in that
//   order reaches max(1, ⌊u · W⌋).
// Each "first in the order where a sum reaches a need" is found without sorting: a radix
// search over the order keys of x (11, 11 and 10 bits, a histogram of weights per digit)
// gives the key, then the tokens of that key are walked in index order.
// Every float operation is an explicit round-to-nearest intrinsic, so NVRTC fuses none
// (the Rust twin fuses none either).
// Row settings: 5 words per row (`ops::sampling`): temperature, top_k, top_p, min_p (f32
// bits, top_k a u32) and the uniform draw u in [0, 1).

#define PARAM_WORDS 5
#define RADIX_BUCKETS 2048
#define FIXED_ONE 1099511627776.0f // 2^40
#define FULL_MASK 0xffffffffu

typedef unsigned long long u64;

// Float bits as an unsigned integer in the order of the floats.
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// e^x for x ≤ 0: the twin's `sampling_exp`, operation for operation.
__device__ float sampling_exp(float x) {
    if (!(x >= -104.0f)) {
        return 0.0f;
    }
    const float n = floorf(__fadd_rn(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)), 0.5f));
    const float r = __fsub_rn(
        __fsub_rn(x, __fmul_rn(n, __uint_as_float(0x3f317200u))),
        __fmul_rn(n, __uint_as_float(0x35bfbe8eu)));
    float p = __uint_as_float(0x3ab60b61u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088889u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3f000000u));
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    int e = (int)n;
    if (e < -126) {
        p = __fmul_rn(p, __uint_as_float(1u << 23)); // 2^-126
        e += 126;
    }
    return __fmul_rn(p, __uint_as_float((unsigned int)(e + 127) << 23));
}

__device__ __forceinline__ u64 fixed(float w) {
    return w > 0.0f ? (u64)__fmul_rn(w, FIXED_ONE) : 0ull;
}

// max(1, ⌊ratio · total⌋), the product in f64.
__device__ __forceinline__ u64 need_of(float ratio, u64 total) {
    const u64 need = ratio > 0.0f ? (u64)__dmul_rn((double)ratio, (double)total) : 0ull;
    return need > 0ull ? need : 1ull;
}

// What a pass over a row weighs.
struct Filter {
    const float* l;
    unsigned int vocab;
    float temperature;
    float x_max;
    // Keys below are out.
    unsigned int floor_key;
    // Weights below are out (by weight only).
    float min_w;
    // 1: every token weighs 1; 0: its fixed-point weight.
    int by_count;
};

// Token i's key, and its weight under `f` (0 when it is out).
__device__ __forceinline__ u64 weigh(const Filter& f, unsigned int i, unsigned int* key) {
    const float x = __fdiv_rn(f.l[i], f.temperature);
    *key = order_key(x);
    if (*key < f.floor_key) {
        return 0ull;
    }
    if (f.by_count) {
        return 1ull;
    }
    const float w = sampling_exp(__fsub_rn(x, f.x_max));
    return w >= f.min_w ? fixed(w) : 0ull;
}

// A search's result.
struct Level {
    unsigned int key;
    int found;
    u64 above; // weight of the keys above `key`
    u64 need;
};

// The largest key whose weight at or above it reaches the need (`absolute`, else
// need_of(ratio, total weight)); found = 0 when the total does not reach it. `hist` and
// `sh` are shared memory; the result is every thread's own copy.
__device__ Level find_level(const Filter& f, u64 absolute, float ratio, u64* hist, Level* sh) {
    const unsigned int tid = threadIdx.x;
    unsigned int prefix = 0u;
    unsigned int mask = 0u;
    __syncthreads(); // every thread is done with `sh` and `hist` from before
    if (tid == 0) {
        sh->above = 0ull;
        sh->found = 1;
    }
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const unsigned int buckets = pass == 2 ? 1024u : 2048u;
        for (unsigned int b = tid; b < buckets; b += blockDim.x) {
            hist[b] = 0ull;
        }
        __syncthreads();
        for (unsigned int i = tid; i < f.vocab; i += blockDim.x) {
            unsigned int key;
            const u64 w = weigh(f, i, &key);
            if (w != 0ull && (key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & (buckets - 1u)], w);
            }
        }
        __syncthreads();
        if (tid < 32) {
            // Lane j sums buckets [top − per, top): lane 0 the highest digits.
            const unsigned int per = buckets / 32u;
            const unsigned int top = buckets - tid * per;
            u64 own = 0ull;
            for (unsigned int b = top - per; b < top; ++b) {
                own += hist[b];
            }
            u64 incl = own;
            for (int o = 1; o < 32; o <<= 1) {
                const u64 v = __shfl_up_sync(FULL_MASK, incl, o);
                if ((int)tid >= o) {
                    incl += v;
                }
            }
            const u64 above = sh->above;
            const u64 total = __shfl_sync(FULL_MASK, incl, 31);
            if (pass == 0 && tid == 0) {
                sh->need = absolute ? absolute : need_of(ratio, total);
            }
            __syncwarp();
            const u64 need = sh->need;
            // Every lane has read `above` and `need` before the crossing lane writes.
            const unsigned int crossed = __ballot_sync(FULL_MASK, above + incl >= need);
            if (crossed == 0u) {
                if (tid == 0) {
                    sh->found = 0;
                }
            } else if ((int)tid == __ffs(crossed) - 1) {
                u64 run = above + incl - own;
                unsigned int digit = top - per;
                for (unsigned int b = top; b-- > top - per;) {
                    if (run + hist[b] >= need) {
                        digit = b;
                        break;
                    }
                    run += hist[b];
                }
                sh->above = run;
                sh->key = digit;
            }
        }
        __syncthreads();
        if (!sh->found) {
            break;
        }
        prefix |= sh->key << shift;
        mask |= (buckets - 1u) << shift;
        __syncthreads(); // every thread has read the digit before the next pass
    }
    Level level = *sh;
    level.key = prefix;
    return level;
}

// The exclusive prefix sum of `v` over the block, and the block's total in `*total`.
// `sums`: 32 words of shared memory.
__device__ unsigned int block_exclusive_scan(unsigned int v, unsigned int* sums, unsigned int* total) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = blockDim.x >> 5;
    unsigned int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned int t = __shfl_up_sync(FULL_MASK, incl, o);
        if ((int)lane >= o) {
            incl += t;
        }
    }
    if (lane == 31u) {
        sums[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned int s = lane < warps ? sums[lane] : 0u;
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned int t = __shfl_up_sync(FULL_MASK, s, o);
            if ((int)lane >= o) {
                s += t;
            }
        }
        sums[lane] = s;
    }
    __syncthreads();
    const unsigned int before = warp > 0 ? sums[warp - 1] : 0u;
    *total = sums[warps - 1];
    __syncthreads();
    return before + incl - v;
}

// The token the draw lands on at `level`: the tokens of that key, in index order, each
// adding the key's weight to `above` until it reaches the need. 0xffffffff if none.
__device__ unsigned int walk_level(const Filter& f, const Level& level, unsigned int* sums, unsigned int* chosen) {
    const unsigned int tid = threadIdx.x;
    const unsigned int chunk = (f.vocab + blockDim.x - 1u) / blockDim.x;
    const unsigned int begin = min(f.vocab, tid * chunk);
    const unsigned int end = min(f.vocab, begin + chunk);
    unsigned int own = 0u;
    for (unsigned int i = begin; i < end; ++i) {
        if (order_key(__fdiv_rn(f.l[i], f.temperature)) == level.key) {
            ++own;
        }
    }
    if (tid == 0) {
        *chosen = 0xffffffffu;
    }
    unsigned int count;
    const unsigned int before = block_exclusive_scan(own, sums, &count);
    const u64 w = fixed(sampling_exp(__fsub_rn(key_value(level.key), f.x_max)));
    if (w == 0ull || count == 0u) {
        return 0xffffffffu;
    }
    u64 nth = (level.need - level.above + w - 1ull) / w;
    nth = nth < 1ull ? 1ull : (nth > count ? count : nth);
    if (own > 0u && before < nth && nth <= before + own) {
        unsigned int seen = before;
        for (unsigned int i = begin; i < end; ++i) {
            if (order_key(__fdiv_rn(f.l[i], f.temperature)) == level.key && ++seen == nth) {
                *chosen = i;
                break;
            }
        }
    }
    __syncthreads();
    return *chosen;
}

// The first index of the maximum of the row; 0xffffffff where nothing is above −∞.
__device__ void row_max(const float* l, unsigned int vocab, float* best_out, unsigned int* at_out,
                        float* vals, unsigned int* idx) {
    const unsigned int tid = threadIdx.x;
    float best = -INFINITY;
    unsigned int at = 0xffffffffu;
    for (unsigned int i = tid; i < vocab; i += blockDim.x) {
        const float v = l[i];
        if (v > best || (v == best && i < at)) {
            best = v;
            at = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, o);
        const unsigned int i = __shfl_xor_sync(FULL_MASK, at, o);
        if (v > best || (v == best && i < at)) {
            best = v;
            at = i;
        }
    }
    if ((tid & 31u) == 0u) {
        vals[tid >> 5] = best;
        idx[tid >> 5] = at;
    }
    __syncthreads();
    if (tid < 32) {
        const bool live = tid < (blockDim.x >> 5);
        best = live ? vals[tid] : -INFINITY;
        at = live ? idx[tid] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(FULL_MASK, best, o);
            const unsigned int i = __shfl_xor_sync(FULL_MASK, at, o);
            if (v > best || (v == best && i < at)) {
                best = v;
                at = i;
            }
        }
        if (tid == 0) {
            *best_out = best;
            *at_out = at;
        }
    }
    __syncthreads();
}

// One token per row of `logits` (rows × vocab; the buffer may hold more rows).
extern "C" __global__ __launch_bounds__(1024) void sample_rows(
    unsigned int* out,
    const float* logits,
    unsigned int vocab,
    const unsigned int* params) {
    __shared__ u64 hist[RADIX_BUCKETS];
    __shared__ float vals[32];
    __shared__ unsigned int idx[32];
    __shared__ float max_value;
    __shared__ unsigned int max_at;
    __shared__ Level search;
    __shared__ unsigned int chosen;
    const unsigned int r = blockIdx.x;
    const unsigned int* p = params + (size_t)r * PARAM_WORDS;
    const float temperature = __uint_as_float(p[0]);
    const unsigned int top_k = p[1];
    const float top_p = __uint_as_float(p[2]);
    const float min_p = __uint_as_float(p[3]);
    const float u = __uint_as_float(p[4]);
    const float* l = logits + (size_t)r * vocab;

    row_max(l, vocab, &max_value, &max_at, vals, idx);
    const float m = max_value;
    // Nothing above −∞ (or only NaN): index 0, as the twin.
    const unsigned int argmax = m > -INFINITY ? max_at : 0u;
    if (!(temperature > 0.0f) || !(m > -INFINITY) || !(m < INFINITY)) {
        if (threadIdx.x == 0) {
            out[r] = argmax;
        }
        return;
    }
    Filter f;
    f.l = l;
    f.vocab = vocab;
    f.temperature = temperature;
    f.x_max = __fdiv_rn(m, temperature);
    f.floor_key = 0u;
    f.min_w = 0.0f;
    f.by_count = 1;
    if (top_k > 0u && top_k < vocab) {
        f.floor_key = find_level(f, top_k, 0.0f, hist, &search).key; // found: k < vocab
    }
    f.by_count = 0;
    if (top_p < 1.0f) {
        const Level level = find_level(f, 0ull, top_p, hist, &search);
        if (level.found) {
            f.floor_key = level.key;
        }
    }
    f.min_w = min_p > 0.0f ? fminf(min_p, 1.0f) : 0.0f;
    const Level level = find_level(f, 0ull, u, hist, &search);
    unsigned int token = 0xffffffffu;
    if (level.found) {
        token = walk_level(f, level, idx, &chosen);
    }
    if (threadIdx.x == 0) {
        // No kept weight, or rounding past the last token: the maximum, as the twin.
        out[r] = token == 0xffffffffu ? argmax : token;
    }
}
