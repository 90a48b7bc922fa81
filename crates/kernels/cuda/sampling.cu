// Sampling, one block per row of logits (blockDim a power of two, at most 1024):
// - temperature ≤ 0: greedy, the first index of the maximum;
// - else p_i = exp((l_i − max) / T) (the largest is 1), and the kept tokens are those with
//   p_i ≥ max(min_p, t_k, t_p): t_k the largest threshold that keeps at least top_k tokens
//   (0: no limit), t_p the largest that keeps at least top_p of the mass (1: no limit),
//   each found by bisection; the token is where the kept mass, summed in index order,
//   first exceeds u · (kept mass), u uniform in [0, 1) from the host.
// Twin: `sampling::sample_threshold` (the same rule for the same u).

#define BISECT_STEPS 32
#define MAX_THREADS 1024

__device__ float mass_at_least(
    const float* l, unsigned int vocab, float m, float inv_t, float t, int count,
    float* scratch) {
    float acc = 0.0f;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float p = __expf((l[i] - m) * inv_t);
        if (p >= t) {
            acc += count ? 1.0f : p;
        }
    }
    return block_sum(acc, scratch);
}

// The largest threshold in [0, 1] whose count (or mass) of tokens at or above it is at
// least `need`.
__device__ float threshold(
    const float* l, unsigned int vocab, float m, float inv_t, float need, int count,
    float* scratch) {
    if (mass_at_least(l, vocab, m, inv_t, 1.0f, count, scratch) >= need) {
        return 1.0f;
    }
    float lo = 0.0f;
    float hi = 1.0f;
    for (int step = 0; step < BISECT_STEPS; ++step) {
        const float mid = 0.5f * (lo + hi);
        if (mass_at_least(l, vocab, m, inv_t, mid, count, scratch) >= need) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Launched with 1024 threads a block: the bound keeps NVRTC within the registers that allows.
extern "C" __global__ __launch_bounds__(1024) void sample_rows(
    unsigned int* out,
    const float* logits,
    unsigned int vocab,
    const float* temperature,
    const unsigned int* top_k,
    const float* top_p,
    const float* min_p,
    const float* uniform) {
    __shared__ float scratch[32];
    __shared__ float vals[MAX_THREADS];
    __shared__ unsigned int idx[MAX_THREADS];
    __shared__ unsigned int chosen;
    const unsigned int r = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    const float* l = logits + (size_t)r * vocab;

    // The maximum, first index on ties.
    float best = -INFINITY;
    unsigned int best_i = 0xffffffffu;
    for (unsigned int i = tid; i < vocab; i += blockDim.x) {
        const float v = l[i];
        if (v > best || (v == best && i < best_i)) {
            best = v;
            best_i = i;
        }
    }
    vals[tid] = best;
    idx[tid] = best_i;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            const float v = vals[tid + s];
            const unsigned int i = idx[tid + s];
            if (v > vals[tid] || (v == vals[tid] && i < idx[tid])) {
                vals[tid] = v;
                idx[tid] = i;
            }
        }
        __syncthreads();
    }
    const float m = vals[0];
    const unsigned int argmax = idx[0];
    __syncthreads();
    const float temp = temperature[r];
    if (!(temp > 0.0f) || !(m > -INFINITY)) {
        if (tid == 0) {
            out[r] = argmax == 0xffffffffu ? 0u : argmax;
        }
        return;
    }
    const float inv_t = 1.0f / temp;

    float t = fminf(fmaxf(min_p[r], 0.0f), 1.0f);
    const unsigned int k = top_k[r];
    if (k > 0 && k < vocab) {
        t = fmaxf(t, threshold(l, vocab, m, inv_t, (float)k, 1, scratch));
    }
    const float p = top_p[r];
    if (p < 1.0f) {
        const float total = mass_at_least(l, vocab, m, inv_t, 0.0f, 0, scratch);
        t = fmaxf(t, threshold(l, vocab, m, inv_t, p * total, 0, scratch));
    }

    // Inverse CDF over the kept tokens in index order: each thread sums a contiguous range.
    const unsigned int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const unsigned int begin = min(vocab, tid * chunk);
    const unsigned int end = min(vocab, begin + chunk);
    float own = 0.0f;
    for (unsigned int i = begin; i < end; ++i) {
        const float q = __expf((l[i] - m) * inv_t);
        if (q >= t) {
            own += q;
        }
    }
    vals[tid] = own;
    if (tid == 0) {
        chosen = 0xffffffffu;
    }
    __syncthreads();
    if (tid == 0) {
        float run = 0.0f;
        for (unsigned int i = 0; i < blockDim.x; ++i) {
            const float v = vals[i];
            vals[i] = run;
            run += v;
        }
        scratch[0] = run;
    }
    __syncthreads();
    const float target = uniform[r] * scratch[0];
    const float before = vals[tid];
    if (own > 0.0f && target >= before && target < before + own) {
        float run = before;
        for (unsigned int i = begin; i < end; ++i) {
            const float q = __expf((l[i] - m) * inv_t);
            if (q >= t) {
                run += q;
                if (target < run) {
                    chosen = i;
                    break;
                }
            }
        }
        if (chosen == 0xffffffffu) {
            chosen = argmax;
        }
    }
    __syncthreads();
    if (tid == 0) {
        // Rounding left the target past the last kept token: the maximum is always kept.
        out[r] = chosen == 0xffffffffu ? argmax : chosen;
    }
}
