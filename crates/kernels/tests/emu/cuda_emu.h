// cuda_emu.h: run a CUDA C kernel source (the dialect NVRTC compiles, no CUDA headers) on
// the CPU, compiled as C++20 by g++, to check kernels for correctness without a GPU.
//
// Include this header first, then the kernel sources, in ONE translation unit:
//
//     #include "cuda_emu.h"
//     #include "prelude.cuh"
//     #include "attention_flash.cu"
//     ... emu::launch(grid, block, [&] { attention_flash_d64(args...); });
//
// Execution model
// - Blocks run one after another on the calling OS thread. A block's threads are
//   cooperative fibers (own stacks, a hand-written x86-64 context switch; ucontext
//   elsewhere or with -DEMU_UCONTEXT) on that same thread, switched only at
//   barriers: __syncthreads, __syncwarp, shuffles, ballots, and the mma. So a lane runs
//   ahead of the rest of its warp until it reaches a warp collective: code that relies
//   on implicit warp-synchronous execution (no __syncwarp) is (correctly) not helped.
// - `__shared__` is `static`: one object per kernel (per template instance) that every
//   fiber of the running block sees, i.e. per-block shared memory because blocks run
//   sequentially. It is NOT cleared between blocks: a kernel that reads shared memory
//   it did not write in this block sees the previous block's values (or zeros).
// - threadIdx/blockIdx/blockDim/gridDim are globals that the scheduler sets on every
//   switch, so each fiber sees its own threadIdx.
// - Atomics are plain read-modify-writes (only one fiber runs at a time, and no fiber
//   switches inside one).
// - Checks: a warp collective whose mask does not include the caller, lanes of a warp
//   meeting at a collective with different masks, a shuffle reading a lane outside the
//   mask, and a deadlock (e.g. __syncthreads or an mma reached by part of a block/warp,
//   a lane that returned while its warp waits in a shuffle) abort with a message naming
//   the block and the waiting threads. __syncthreads completing after some of the
//   block's threads have returned is allowed (exited threads no longer count) but
//   reported once per launch on stderr, as CUDA leaves it undefined.
//
// Floating point: the CPU's f32 ops are IEEE round-to-nearest like the GPU's, but g++
// and NVRTC contract a*b+c into fma differently (NVRTC does by default; g++ does not
// at -std=c++20 without -ffp-contract=fast -mfma), and exp2f/expf/sincosf/__expf are
// libm's, not the GPU's approximations: compare results with a tolerance, except
// where a kernel uses only explicit _rn intrinsics.
//
// Build: g++ -std=c++20 -O1 -pthread -fno-strict-aliasing -Wno-unknown-pragmas
// (-fno-strict-aliasing because kernels read bf16 arrays through uint4 pointers).

#pragma once

#define TESSERA_EMULATE 1

#include <math.h>
#include <string.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_UCONTEXT 1
#endif
#ifdef EMU_UCONTEXT
#include <ucontext.h>
#endif

// prelude.cuh defines INFINITY itself (NVRTC has no math.h).
#undef INFINITY

// ---------------------------------------------------------------------------------------
// Qualifiers.

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static
#define __managed__
#define __align__(n) __attribute__((aligned(n)))
// __restrict__ is a g++ keyword already.

// ---------------------------------------------------------------------------------------
// Vector types.

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct float3 {
    float x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(4) ushort2 {
    unsigned short x, y;
};
struct alignas(8) ushort4 {
    unsigned short x, y, z, w;
};

constexpr uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
constexpr uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return {x, y, z}; }
constexpr uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return {x, y, z, w};
}
constexpr int2 make_int2(int x, int y) { return {x, y}; }
constexpr int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
constexpr float2 make_float2(float x, float y) { return {x, y}; }
constexpr float3 make_float3(float x, float y, float z) { return {x, y, z}; }
constexpr float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
constexpr ushort2 make_ushort2(unsigned short x, unsigned short y) { return {x, y}; }

constexpr int warpSize = 32;

// The running thread's coordinates (set by the scheduler at each fiber switch).
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

// ---------------------------------------------------------------------------------------
// Fibers and the block scheduler.

namespace emu {

[[noreturn]] inline void fail(const char* what) {
    fprintf(stderr,
            "cuda_emu: %s (block (%u,%u,%u), thread (%u,%u,%u))\n",
            what,
            blockIdx.x, blockIdx.y, blockIdx.z,
            threadIdx.x, threadIdx.y, threadIdx.z);
    fflush(stderr);
    abort();
}

#ifndef EMU_UCONTEXT
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save and resumes the context whose stack pointer is `to`.
__attribute__((naked, noinline, noipa)) static void ctx_switch(void** /*save*/, void* /*to*/) {
    asm("pushq %rbp\n\t"
        "pushq %rbx\n\t"
        "pushq %r12\n\t"
        "pushq %r13\n\t"
        "pushq %r14\n\t"
        "pushq %r15\n\t"
        "subq $8, %rsp\n\t"
        "stmxcsr (%rsp)\n\t"
        "fnstcw 4(%rsp)\n\t"
        "movq %rsp, (%rdi)\n\t"
        "movq %rsi, %rsp\n\t"
        "ldmxcsr (%rsp)\n\t"
        "fldcw 4(%rsp)\n\t"
        "addq $8, %rsp\n\t"
        "popq %r15\n\t"
        "popq %r14\n\t"
        "popq %r13\n\t"
        "popq %r12\n\t"
        "popq %rbx\n\t"
        "popq %rbp\n\t"
        "ret\n\t");
}
// First code a new fiber runs: r13(r12), which never returns.
__attribute__((naked, noinline, noipa)) static void ctx_trampoline() {
    asm("movq %r12, %rdi\n\t"
        "callq *%r13\n\t"
        "ud2\n\t");
}
#endif

struct Fiber {
    char* stack = nullptr;   // mapping base (guard page first)
    size_t mapped = 0;
    uint3 tid{};
    bool done = false;
    // Waiting: resumed only when *wait_word != wait_value.
    const unsigned int* wait_word = nullptr;
    unsigned int wait_value = 0;
    const char* wait_what = nullptr;
#ifdef EMU_UCONTEXT
    ucontext_t ctx;
#else
    void* sp = nullptr;
#endif
};

struct Barrier {
    unsigned int count = 0; // arrived in the current generation
    unsigned int gen = 0;
    unsigned int mask = 0;  // warp barriers: the lanes taking part
    const char* what = nullptr;
};

struct Warp {
    Barrier slots[8];
    uint64_t val[32];
    unsigned int mma_a[32][4];
    unsigned int mma_b[32][2];
};

struct State {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    Barrier block_bar;
    unsigned int live = 0;   // fibers of the block not yet returned
    unsigned int nthreads = 0;
    Fiber* current = nullptr;
    bool warned_exited_sync = false;
    void (*body)(void*) = nullptr;
    void* body_ctx = nullptr;
#ifdef EMU_UCONTEXT
    ucontext_t sched_ctx;
#else
    void* sched_sp = nullptr;
#endif
};

inline State g;

inline size_t stack_bytes() {
    const char* env = getenv("EMU_STACK_KB");
    size_t kb = env ? strtoul(env, nullptr, 10) : 1024;
    if (kb < 64) {
        kb = 64;
    }
    return kb * 1024;
}

inline void yield_to_scheduler() {
    Fiber* f = g.current;
    asm volatile("" ::: "memory");
#ifdef EMU_UCONTEXT
    swapcontext(&f->ctx, &g.sched_ctx);
#else
    ctx_switch(&f->sp, g.sched_sp);
#endif
    asm volatile("" ::: "memory");
}

// Blocks the running fiber until *word changes from `value`.
inline void wait_while(const unsigned int* word, unsigned int value, const char* what) {
    Fiber* f = g.current;
    f->wait_word = word;
    f->wait_value = value;
    f->wait_what = what;
    while (*word == value) {
        yield_to_scheduler();
    }
    f->wait_word = nullptr;
    f->wait_what = nullptr;
}

inline void fiber_main(Fiber* f) {
    g.body(g.body_ctx);
    f->done = true;
    g.live--;
    // Threads waiting at __syncthreads no longer wait for this one.
    if (g.block_bar.count > 0 && g.block_bar.count >= g.live) {
        g.block_bar.count = 0;
        g.block_bar.gen++;
    }
    for (;;) {
        yield_to_scheduler(); // never resumed
    }
}

#ifdef EMU_UCONTEXT
inline void fiber_entry_uc(unsigned int hi, unsigned int lo) {
    fiber_main(reinterpret_cast<Fiber*>(((uintptr_t)hi << 32) | lo));
}
#else
inline void fiber_entry(Fiber* f) { fiber_main(f); }
#endif

inline void ensure_fibers(unsigned int n) {
    const size_t bytes = stack_bytes();
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (g.fibers.size() < n) {
        g.fibers.resize(n);
    }
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = g.fibers[i];
        if (f.stack == nullptr || f.mapped != bytes + page) {
            if (f.stack != nullptr) {
                munmap(f.stack, f.mapped);
            }
            void* p = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                fail("cannot map a fiber stack");
            }
            mprotect(p, page, PROT_NONE); // guard page: an overflow faults
            f.stack = static_cast<char*>(p);
            f.mapped = bytes + page;
        }
    }
}

inline void init_fiber(Fiber& f) {
    f.done = false;
    f.wait_word = nullptr;
    f.wait_what = nullptr;
#ifdef EMU_UCONTEXT
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack + page;
    f.ctx.uc_stack.ss_size = f.mapped - page;
    f.ctx.uc_link = nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
    makecontext(&f.ctx, (void (*)())fiber_entry_uc, 2, (unsigned int)(p >> 32),
                (unsigned int)(p & 0xffffffffu));
#else
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + f.mapped) & ~(uintptr_t)15;
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 64);
    sp[0] = 0x037f00001f80ull; // MXCSR default (low), x87 control word default (high)
    sp[1] = 0;                                                     // r15
    sp[2] = 0;                                                     // r14
    sp[3] = reinterpret_cast<uint64_t>(&fiber_entry);              // r13
    sp[4] = reinterpret_cast<uint64_t>(&f);                        // r12
    sp[5] = 0;                                                     // rbx
    sp[6] = 0;                                                     // rbp
    sp[7] = reinterpret_cast<uint64_t>(&ctx_trampoline);          // return address
    f.sp = sp;
#endif
}

inline void resume(Fiber& f) {
    g.current = &f;
    threadIdx = f.tid;
    asm volatile("" ::: "memory");
#ifdef EMU_UCONTEXT
    swapcontext(&g.sched_ctx, &f.ctx);
#else
    ctx_switch(&g.sched_sp, f.sp);
#endif
    asm volatile("" ::: "memory");
    g.current = nullptr;
}

[[noreturn]] inline void report_deadlock() {
    fprintf(stderr,
            "cuda_emu: deadlock in block (%u,%u,%u): %u of %u threads never get past a "
            "barrier or warp collective:\n",
            blockIdx.x, blockIdx.y, blockIdx.z, g.live, g.nthreads);
    unsigned int shown = 0;
    for (unsigned int i = 0; i < g.nthreads; ++i) {
        const Fiber& f = g.fibers[i];
        if (f.done) {
            continue;
        }
        if (shown++ < 64) {
            fprintf(stderr, "  thread (%u,%u,%u) (warp %u lane %u) waits in %s\n",
                    f.tid.x, f.tid.y, f.tid.z, i / 32, i % 32,
                    f.wait_what ? f.wait_what : "?");
        }
    }
    unsigned int exited = 0;
    for (unsigned int i = 0; i < g.nthreads; ++i) {
        exited += g.fibers[i].done ? 1 : 0;
    }
    fprintf(stderr, "  (%u threads had returned)\n", exited);
    fflush(stderr);
    abort();
}

inline void run_block(unsigned int n) {
    g.nthreads = n;
    g.live = n;
    g.block_bar = Barrier{};
    const unsigned int nwarps = (n + 31) / 32;
    g.warps.assign(nwarps, Warp{});
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = g.fibers[i];
        f.tid = uint3{i % blockDim.x, (i / blockDim.x) % blockDim.y,
                      i / (blockDim.x * blockDim.y)};
        init_fiber(f);
    }
    while (g.live > 0) {
        bool resumed = false;
        for (unsigned int i = 0; i < n; ++i) {
            Fiber& f = g.fibers[i];
            if (f.done) {
                continue;
            }
            if (f.wait_word != nullptr && *f.wait_word == f.wait_value) {
                continue; // still blocked
            }
            resumed = true;
            resume(f);
        }
        if (!resumed) {
            report_deadlock();
        }
    }
}

// The running thread's index in the block, its warp and lane (warps are 32 consecutive
// linear thread indices).
inline unsigned int linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

inline void block_sync() {
    Barrier& b = g.block_bar;
    b.count++;
    if (b.count >= g.live) {
        if (g.live < g.nthreads && !g.warned_exited_sync) {
            g.warned_exited_sync = true;
            fprintf(stderr,
                    "cuda_emu: warning: __syncthreads() in block (%u,%u,%u) completed with "
                    "%u of %u threads already returned (undefined in CUDA)\n",
                    blockIdx.x, blockIdx.y, blockIdx.z, g.nthreads - g.live, g.nthreads);
        }
        b.count = 0;
        b.gen++;
        return;
    }
    wait_while(&b.gen, b.gen, "__syncthreads");
}

// All lanes of `mask` (which must include the caller) arrive before any leaves. Groups
// of a warp with different masks (e.g. the two halves of a divergent warp) synchronise
// independently, each on its own barrier slot; lanes that meet with the same mask must
// be in the same kind of collective.
inline void warp_sync(unsigned int mask, const char* what) {
    const unsigned int t = linear_tid();
    const unsigned int lane = t & 31u;
    Warp& w = g.warps[t >> 5];
    if (((mask >> lane) & 1u) == 0) {
        fail("warp collective called with a mask that excludes the calling lane");
    }
    // Lanes past the end of a partial last warp cannot take part.
    const unsigned int warp_lanes = g.nthreads - (t & ~31u);
    if (warp_lanes < 32 && (mask >> warp_lanes) != 0) {
        fail("warp collective mask names lanes past the block's last thread");
    }
    Barrier* b = nullptr;
    for (Barrier& s : w.slots) {
        if (s.count > 0 && s.mask == mask) {
            b = &s;
            break;
        }
    }
    if (b == nullptr) {
        for (Barrier& s : w.slots) {
            if (s.count == 0) {
                b = &s;
                break;
            }
        }
        if (b == nullptr) {
            fail("too many concurrent warp collectives with different masks in one warp");
        }
        b->mask = mask;
        b->what = what;
    } else if (b->what != what) {
        fprintf(stderr, "cuda_emu: lanes of a warp wait in %s and in %s with mask %#x\n",
                b->what, what, mask);
        fail("lanes of one warp are in different warp collectives");
    }
    b->count++;
    if (b->count == (unsigned int)std::popcount(mask)) {
        b->count = 0;
        b->gen++;
        return;
    }
    wait_while(&b->gen, b->gen, what);
}

inline Warp& my_warp() { return g.warps[linear_tid() >> 5]; }
inline unsigned int my_lane() { return linear_tid() & 31u; }

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of this type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}

// The shuffle family: every lane of `mask` publishes `v`, then reads lane src(lane).
template <class T, class Src>
inline T shuffle(unsigned int mask, T v, Src src_of, const char* what) {
    Warp& w = my_warp();
    const unsigned int lane = my_lane();
    w.val[lane] = to_bits(v);
    warp_sync(mask, what);
    const unsigned int src = src_of(lane);
    if (((mask >> src) & 1u) == 0) {
        fail("shuffle reads a lane outside its mask (undefined in CUDA)");
    }
    const T r = from_bits<T>(w.val[src]);
    warp_sync(mask, what); // nobody overwrites val before all have read it
    return r;
}

// A 32-bit lane value combined over the mask's lanes.
template <class Op>
inline unsigned int warp_reduce(unsigned int mask, unsigned int v, Op op, const char* what) {
    Warp& w = my_warp();
    const unsigned int lane = my_lane();
    w.val[lane] = v;
    warp_sync(mask, what);
    unsigned int r = 0;
    bool first = true;
    for (unsigned int l = 0; l < 32; ++l) {
        if ((mask >> l) & 1u) {
            r = first ? op(l, (unsigned int)w.val[l], 0u, true) : op(l, (unsigned int)w.val[l], r, false);
            first = false;
        }
    }
    warp_sync(mask, what);
    return r;
}

inline float bf16_lo(unsigned int r) { return std::bit_cast<float>(r << 16); }
inline float bf16_hi(unsigned int r) { return std::bit_cast<float>(r & 0xffff0000u); }


// Runs `body()` once for every thread of every block of the grid.
template <class F>
void launch(dim3 grid, dim3 block, F&& body) {
    const unsigned long long n = (unsigned long long)block.x * block.y * block.z;
    if (n == 0 || n > 1024) {
        fprintf(stderr, "cuda_emu: invalid block size %llu\n", n);
        abort();
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) {
        fprintf(stderr, "cuda_emu: invalid grid (%u,%u,%u)\n", grid.x, grid.y, grid.z);
        abort();
    }
    if (g.current != nullptr) {
        fprintf(stderr, "cuda_emu: launch from inside a kernel\n");
        abort();
    }
    using Body = std::remove_reference_t<F>;
    g.body = [](void* ctx) { (*static_cast<Body*>(ctx))(); };
    g.body_ctx = const_cast<void*>(static_cast<const void*>(&body));
    g.warned_exited_sync = false;
    ensure_fibers((unsigned int)n);
    gridDim = grid;
    blockDim = block;
    for (unsigned int z = 0; z < grid.z; ++z) {
        for (unsigned int y = 0; y < grid.y; ++y) {
            for (unsigned int x = 0; x < grid.x; ++x) {
                blockIdx = uint3{x, y, z};
                run_block((unsigned int)n);
            }
        }
    }
    threadIdx = uint3{0, 0, 0};
}

// launch_kernel(grid, block, kernel, args...): the <<<grid, block>>> of a kernel.
template <class... P, class... A>
void launch_kernel(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
    launch(grid, block, [&] { kernel(args...); });
}

} // namespace emu

// The intrinsics kernels call: barriers, shuffles, the mma, float and integer intrinsics.
#include "cuda_emu_intrinsics.h"
