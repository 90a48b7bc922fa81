// Self-test of cuda_emu.h (crates/kernels/tests/emulated.rs builds and runs it). By hand,
// from the repository's root:
//   g++ -std=c++20 -O1 -pthread -fno-strict-aliasing -Wno-unknown-pragmas \
//       -I crates/kernels/tests/emu -I crates/kernels/cuda \
//       crates/kernels/tests/emu/test_mma.cpp -o /tmp/test_mma && /tmp/test_mma
#include "cuda_emu.h"
#include "prelude.cuh"

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

static int failures = 0;
#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            if (failures < 20) {                                                            \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                        \
                fprintf(stderr, __VA_ARGS__);                                               \
                fprintf(stderr, "\n");                                                      \
            }                                                                               \
            ++failures;                                                                     \
        }                                                                                   \
    } while (0)

// ---------------------------------------------------------------------------------------
// 1. mma: each warp of the block multiplies its own matrices, twice (the second product
// accumulating on the first), from fragments that each lane builds straight from the
// full matrices with the PTX ISA's per-element formulas (written per element index i,
// independently of the register table in cuda_emu.h).

struct MmaCase {
    std::vector<float> a1, b1, a2, b2, c; // per warp: 16x16, 16x8, 16x16, 16x8, 16x8
};

static bf16_t bf(float x) { return f32_to_bf16(x); }

__global__ void mma_kernel(float* d_out, const bf16_t* a1, const bf16_t* b1, const bf16_t* a2,
                           const bf16_t* b2, const float* c) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int groupID = lane >> 2;
    const unsigned int tig = lane % 4;
    auto afrag = [&](const bf16_t* A, unsigned int* reg) {
        for (int r = 0; r < 4; ++r) reg[r] = 0;
        for (int i = 0; i < 8; ++i) {
            const unsigned int row = ((0 <= i && i < 2) || (4 <= i && i < 6)) ? groupID : groupID + 8;
            const unsigned int col = i < 4 ? (tig * 2) + (i & 0x1) : (tig * 2) + (i & 0x1) + 8;
            // Elements low to high: a_{2r} is bits 0..15 of register r.
            reg[i / 2] |= (unsigned int)A[row * 16 + col] << (16 * (i % 2));
        }
    };
    auto bfrag = [&](const bf16_t* B, unsigned int* reg) {
        reg[0] = reg[1] = 0;
        for (int i = 0; i < 4; ++i) {
            const unsigned int row = i < 2 ? (tig * 2) + (i & 0x1) : (tig * 2) + (i & 0x1) + 8;
            const unsigned int col = groupID;
            reg[i / 2] |= (unsigned int)B[row * 8 + col] << (16 * (i % 2));
        }
    };
    auto crow = [&](int i) { return i < 2 ? groupID : groupID + 8; };
    auto ccol = [&](int i) { return (tig * 2) + (i & 0x1); };

    unsigned int ra[4], rb[2];
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = c[warp * 128 + crow(i) * 8 + ccol(i)];
    afrag(a1 + warp * 256, ra);
    bfrag(b1 + warp * 128, rb);
    mma_m16n8k16_bf16(d, ra, rb);
    afrag(a2 + warp * 256, ra);
    bfrag(b2 + warp * 128, rb);
    mma_m16n8k16_bf16(d, ra, rb);
    for (int i = 0; i < 4; ++i) d_out[warp * 128 + crow(i) * 8 + ccol(i)] = d[i];
}

static void test_mma(bool integers, unsigned int seed) {
    const int warps = 4;
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> small(-8, 8);
    std::uniform_real_distribution<float> real(-2.0f, 2.0f);
    auto gen = [&] { return integers ? (float)small(rng) : bf16_to_f32(bf(real(rng))); };
    std::vector<bf16_t> a1(warps * 256), b1(warps * 128), a2(warps * 256), b2(warps * 128);
    std::vector<float> fa1(a1.size()), fb1(b1.size()), fa2(a2.size()), fb2(b2.size());
    std::vector<float> c(warps * 128), d(warps * 128, NAN);
    for (size_t i = 0; i < a1.size(); ++i) { fa1[i] = gen(); a1[i] = bf(fa1[i]); fa2[i] = gen(); a2[i] = bf(fa2[i]); }
    for (size_t i = 0; i < b1.size(); ++i) { fb1[i] = gen(); b1[i] = bf(fb1[i]); fb2[i] = gen(); b2[i] = bf(fb2[i]); }
    for (auto& x : c) x = integers ? (float)small(rng) : real(rng);

    emu::launch(dim3(1), dim3(32 * warps), [&] {
        mma_kernel(d.data(), a1.data(), b1.data(), a2.data(), b2.data(), c.data());
    });

    double worst = 0;
    for (int w = 0; w < warps; ++w) {
        for (int i = 0; i < 16; ++i) {
            for (int j = 0; j < 8; ++j) {
                double ref = c[w * 128 + i * 8 + j];
                for (int k = 0; k < 16; ++k) {
                    ref += (double)fa1[w * 256 + i * 16 + k] * fb1[w * 128 + k * 8 + j];
                    ref += (double)fa2[w * 256 + i * 16 + k] * fb2[w * 128 + k * 8 + j];
                }
                const float got = d[w * 128 + i * 8 + j];
                if (integers) {
                    CHECK(got == (float)ref, "mma int warp %d D[%d][%d] = %g, want %g", w, i, j, got, ref);
                } else {
                    const double err = std::fabs(got - ref) / (1.0 + std::fabs(ref));
                    worst = std::max(worst, err);
                    CHECK(err < 1e-5, "mma real warp %d D[%d][%d] = %.9g, want %.9g", w, i, j, got, ref);
                }
            }
        }
    }
    printf("mma m16n8k16 bf16 (%s, 4 warps, 2 chained products): %s%s\n",
           integers ? "integers, exact" : "random bf16, rel err",
           failures ? "see failures" : "ok",
           integers ? "" : (std::string(", worst ") + std::to_string(worst)).c_str());
}

// ---------------------------------------------------------------------------------------
// 2. Shuffles and ballot: each thread checks what it receives against the formula.

__global__ void shuffle_kernel(unsigned int* errors) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    auto fval = [&](unsigned int l) { return (float)(warp * 100 + l) + 0.25f; };
    auto uval = [&](unsigned int l) { return warp * 1000u + l * 7u + 1u; };
    unsigned int bad = 0;
    for (int o = 1; o < 32; ++o) {
        bad += __shfl_xor_sync(0xffffffffu, fval(lane), o) != fval(lane ^ o);
        bad += __shfl_xor_sync(0xffffffffu, uval(lane), o) != uval(lane ^ o);
    }
    for (unsigned int s = 0; s < 32; ++s) {
        const unsigned int src = (lane * 7u + s) % 32u;
        bad += __shfl_sync(0xffffffffu, fval(lane), (int)src) != fval(src);
        bad += __shfl_sync(0xffffffffu, uval(lane), (int)src) != uval(src);
    }
    for (unsigned int dlt = 1; dlt < 32; dlt <<= 1) {
        bad += __shfl_down_sync(0xffffffffu, fval(lane), dlt) != fval(lane + dlt < 32 ? lane + dlt : lane);
        bad += __shfl_up_sync(0xffffffffu, uval(lane), dlt) != uval(lane >= dlt ? lane - dlt : lane);
        // width 8: sub-groups of 8 lanes.
        const unsigned int base = lane & ~7u;
        bad += __shfl_down_sync(0xffffffffu, uval(lane), dlt, 8) != uval(lane + dlt < base + 8 ? lane + dlt : lane);
    }
    bad += __shfl_sync(0xffffffffu, uval(lane), 3, 8) != uval((lane & ~7u) + 3);
    bad += __shfl_xor_sync(0xffffffffu, uval(lane), 4, 8) != uval(lane ^ 4);
    // 64-bit values.
    const unsigned long long big = (1ull << 40) * (lane + 1) + warp;
    bad += __shfl_xor_sync(0xffffffffu, big, 5) != (1ull << 40) * ((lane ^ 5) + 1) + warp;
    // Ballot: lanes whose index has bit 0 set, plus lane 2 in warp 1.
    const unsigned int want = 0xaaaaaaaau | (warp == 1 ? 4u : 0u);
    bad += __ballot_sync(0xffffffffu, (lane & 1u) || (warp == 1 && lane == 2)) != want;
    // A half-warp mask: lanes 0..15 only.
    if (lane < 16) {
        bad += __shfl_xor_sync(0x0000ffffu, uval(lane), 1) != uval(lane ^ 1);
        __syncwarp(0x0000ffffu);
    }
    __syncwarp();
    // warp_sum / warp_max of the prelude.
    bad += warp_sum((float)lane) != 496.0f;
    bad += warp_max((float)((lane * 13) % 32)) != 31.0f;
    atomicAdd(errors, bad);
}

// ---------------------------------------------------------------------------------------
// 3. __syncthreads and per-block shared memory: a tree reduction in shared memory, the
// prelude's block_sum/block_max, and a neighbour exchange, over several blocks.

__global__ void reduce_kernel(float* sums, float* psum, float* pmax, unsigned int* errors, const float* x,
                              unsigned int n) {
    __shared__ float buf[256];
    __shared__ float scratch[32];
    __shared__ unsigned int ring[256];
    const unsigned int t = threadIdx.x;
    const unsigned int i = blockIdx.x * blockDim.x + t;
    buf[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            buf[t] += buf[t + s];
        }
        __syncthreads();
    }
    if (t == 0) {
        sums[blockIdx.x] = buf[0];
    }
    const float v = i < n ? x[i] : 0.0f;
    const float bs = block_sum(v, scratch);
    const float bm = block_max(i < n ? x[i] : -INFINITY, scratch);
    if (t == 0) {
        psum[blockIdx.x] = bs;
        pmax[blockIdx.x] = bm;
    }
    // Everyone agrees on the block sum (block_sum's contract).
    if (bs != __shfl_sync(0xffffffffu, bs, 0)) atomicAdd(errors, 1u);
    ring[t] = blockIdx.x * 1000u + t;
    __syncthreads();
    const unsigned int next = (t + 1) % blockDim.x;
    if (ring[next] != blockIdx.x * 1000u + next) atomicAdd(errors, 1u);
}

// ---------------------------------------------------------------------------------------
// 4. A 2-D block: threadIdx.y and a shuffle over warps that span rows.

__global__ void dims_kernel(unsigned int* out) {
    const unsigned int lin = threadIdx.x + blockDim.x * threadIdx.y;
    const unsigned int got = __shfl_xor_sync(0xffffffffu, lin, 1);
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x * blockDim.y + lin] =
        got + 10000u * (blockIdx.y * gridDim.x + blockIdx.x);
}

// ---------------------------------------------------------------------------------------
// 5. Misuse is caught: run in a child process, expect an abort.

__global__ void divergent_shuffle_kernel(float* out) {
    float v = (float)threadIdx.x;
    if ((threadIdx.x & 31u) != 7u) { // lane 7 skips the shuffle
        v += __shfl_xor_sync(0xffffffffu, v, 1);
    }
    out[threadIdx.x] = v;
}
__global__ void divergent_mma_kernel(float* out) {
    float d[4] = {0, 0, 0, 0};
    const unsigned int a[4] = {0, 0, 0, 0};
    const unsigned int b[2] = {0, 0};
    if (threadIdx.x < 16) { // half a warp
        mma_m16n8k16_bf16(d, a, b);
    }
    out[threadIdx.x] = d[0];
}

template <class F>
static bool aborts(F f) {
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        f();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

int main() {
    // 1
    test_mma(true, 1);
    test_mma(true, 2);
    test_mma(false, 3);
    test_mma(false, 4);

    // 2
    {
        unsigned int errors = 0;
        emu::launch(dim3(3), dim3(96), [&] { shuffle_kernel(&errors); });
        CHECK(errors == 0, "shuffles: %u wrong values", errors);
        printf("shuffles (xor/idx/down/up, widths 32 and 8, float/u32/u64, ballot, half-warp mask, warp_sum/max): %s\n",
               errors == 0 ? "ok" : "FAILED");
    }

    // 3
    {
        const unsigned int n = 1000, threads = 256, blocks = (n + threads - 1) / threads;
        std::vector<float> x(n);
        std::mt19937 rng(7);
        std::uniform_int_distribution<int> dist(-50, 50);
        for (auto& v : x) v = (float)dist(rng); // integers: every order of summing is exact
        std::vector<float> sums(blocks), psum(blocks), pmax(blocks);
        unsigned int errors = 0;
        emu::launch(dim3(blocks), dim3(threads), [&] {
            reduce_kernel(sums.data(), psum.data(), pmax.data(), &errors, x.data(), n);
        });
        int bad = 0;
        for (unsigned int b = 0; b < blocks; ++b) {
            float ref = 0, mx = -INFINITY;
            for (unsigned int i = b * threads; i < std::min(n, (b + 1) * threads); ++i) {
                ref += x[i];
                mx = std::max(mx, x[i]);
            }
            CHECK(sums[b] == ref, "tree reduction block %u: %g, want %g", b, sums[b], ref);
            CHECK(psum[b] == ref, "block_sum block %u: %g, want %g", b, psum[b], ref);
            CHECK(pmax[b] == mx, "block_max block %u: %g, want %g", b, pmax[b], mx);
            bad += sums[b] != ref || psum[b] != ref || pmax[b] != mx;
        }
        CHECK(errors == 0, "reduce kernel: %u thread-side errors", errors);
        printf("__syncthreads + shared memory (tree reduction, prelude block_sum/block_max, ring exchange; %u blocks of %u): %s\n",
               blocks, threads, bad == 0 && errors == 0 ? "ok" : "FAILED");
    }

    // 4
    {
        const dim3 grid(2, 3), block(16, 4);
        std::vector<unsigned int> out(6 * 64);
        emu::launch(grid, block, [&] { dims_kernel(out.data()); });
        unsigned int bad = 0;
        for (unsigned int b = 0; b < 6; ++b)
            for (unsigned int l = 0; l < 64; ++l) bad += out[b * 64 + l] != (l ^ 1u) + 10000u * b;
        CHECK(bad == 0, "2-D block: %u wrong", bad);
        printf("2-D grid and block (threadIdx.y, blockIdx.y, gridDim): %s\n", bad == 0 ? "ok" : "FAILED");
    }

    // 5
    {
        std::vector<float> out(64);
        const bool a = aborts([&] { emu::launch(dim3(1), dim3(64), [&] { divergent_shuffle_kernel(out.data()); }); });
        const bool b = aborts([&] { emu::launch(dim3(1), dim3(32), [&] { divergent_mma_kernel(out.data()); }); });
        CHECK(a, "a shuffle skipped by one lane was not reported");
        CHECK(b, "an mma reached by half a warp was not reported");
        printf("misuse detected (shuffle skipped by a lane, mma by half a warp): %s\n", a && b ? "ok" : "FAILED");
    }

    printf(failures == 0 ? "ALL OK\n" : "%d FAILURES\n", failures);
    return failures == 0 ? 0 : 1;
}
