// The CUDA C that the engine's kernels use, on the CPU, so that the tests run every kernel
// without a GPU (src/gpu/emulator.rs). Each thread of a block is an OS thread; the blocks of a
// launch run one after another; __syncthreads and the warp shuffles are barriers among those
// threads. It checks what a kernel computes, not how fast: a GPU still has the last word
// (memory model, fused multiply-adds, blocks running at once).
#pragma once
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#define __global__
// Each kernel file sits in an unnamed namespace of its own translation unit (emulator.rs), so
// its device functions need no `static` to stay apart from another file's of the same name.
#define __device__
#define __host__
#define __forceinline__
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace emu {

// A barrier that threads may leave for the rest of a block (those that return early).
struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    int expected = 0, arrived = 0;
    long generation = 0;

    void reset(int n) {
        expected = n;
        arrived = 0;
    }
    void release_if_complete() {
        if (arrived >= expected && expected > 0) {
            arrived = 0;
            generation++;
            cv.notify_all();
        }
    }
    void wait() {
        std::unique_lock<std::mutex> lock(m);
        long g = generation;
        arrived++;
        if (arrived >= expected) {
            arrived = 0;
            generation++;
            cv.notify_all();
            return;
        }
        cv.wait(lock, [&] { return generation != g; });
    }
    void leave() {
        std::lock_guard<std::mutex> lock(m);
        expected--;
        release_if_complete();
    }
};

struct Launch {
    dim3 grid, block;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<uint64_t> warp_slots;
    std::vector<unsigned char> dynamic_shared;
};

inline thread_local Launch* current = nullptr;
inline thread_local int thread_rank = 0;
inline std::mutex one_launch_at_a_time;

}  // namespace emu

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// Dynamic shared memory: `DYNAMIC_SHARED(float, buf);` declares `buf`, as
// `extern __shared__ float buf[];` does on a GPU (reduce.cuh defines it there).
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::current->dynamic_shared.data())

static inline void __syncthreads() { emu::current->block_barrier.wait(); }
static inline void __syncwarp(unsigned int = 0xffffffffu) {
    emu::current->warp_barriers[emu::thread_rank / 32].wait();
}

// Lane `from(lane)`'s `v`, for every lane of the warp.
template <class T, class F>
static inline T emu_exchange(T v, F from) {
    static_assert(sizeof(T) <= 8);
    int lane = emu::thread_rank % 32, warp = emu::thread_rank / 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu::current->warp_slots[emu::thread_rank] = bits;
    __syncwarp();
    int src = from(lane);
    bits = emu::current->warp_slots[warp * 32 + src];
    __syncwarp();
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
template <class T>
static inline T __shfl_xor_sync(unsigned int, T v, int mask) {
    return emu_exchange(v, [&](int lane) { return (lane ^ mask) & 31; });
}
template <class T>
static inline T __shfl_down_sync(unsigned int, T v, unsigned int delta) {
    return emu_exchange(v, [&](int lane) { return lane + (int)delta < 32 ? lane + (int)delta : lane; });
}
template <class T>
static inline T __shfl_up_sync(unsigned int, T v, unsigned int delta) {
    return emu_exchange(v, [&](int lane) { return lane >= (int)delta ? lane - (int)delta : lane; });
}
template <class T>
static inline T __shfl_sync(unsigned int, T v, int src) {
    return emu_exchange(v, [&](int) { return src & 31; });
}

template <class T>
static inline T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}
static inline int atomicAnd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_and(v); }
static inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
static inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
static inline unsigned int atomicCAS(unsigned int* p, unsigned int expect, unsigned int v) {
    std::atomic_ref<unsigned int>(*p).compare_exchange_strong(expect, v);
    return expect;
}

// glibc declares __expf and __logf itself.
using std::isfinite;
using std::isinf;
using std::isnan;
static inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
static inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
static inline unsigned int __float_as_uint(float v) { return std::bit_cast<unsigned int>(v); }
static inline float __uint_as_float(unsigned int v) { return std::bit_cast<float>(v); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return std::sqrt(a); }
static inline float __double2float_rn(double a) { return (float)a; }
using std::max;
using std::min;

namespace emu {

using Kernel = std::function<void()>;

// Runs `kernel` over the grid: each block's threads as OS threads, the blocks one by one.
inline int run(const dim3& grid, const dim3& block, unsigned int shared_bytes, const Kernel& kernel) {
    std::lock_guard<std::mutex> one(one_launch_at_a_time);
    int threads = (int)(block.x * block.y * block.z);
    if (threads <= 0 || threads > 1024) return 1;
    Launch launch;
    launch.grid = grid;
    launch.block = block;
    launch.warp_barriers = std::vector<Barrier>((threads + 31) / 32);
    launch.warp_slots.assign((size_t)((threads + 31) / 32) * 32, 0);
    launch.dynamic_shared.assign(shared_bytes, 0);
    Barrier end_of_block;
    end_of_block.reset(threads);
    auto start_block = [&] {
        launch.block_barrier.reset(threads);
        for (int w = 0; w < (int)launch.warp_barriers.size(); w++) {
            launch.warp_barriers[w].reset(std::min(32, threads - 32 * w));
        }
    };
    start_block();
    std::mutex block_done;
    long blocks_done = 0;
    long blocks = (long)grid.x * grid.y * grid.z;
    std::vector<std::thread> pool;
    for (int rank = 0; rank < threads; rank++) {
        pool.emplace_back([&, rank] {
            current = &launch;
            thread_rank = rank;
            blockDim = block;
            gridDim = grid;
            threadIdx = dim3{(unsigned)(rank % block.x), (unsigned)(rank / block.x % block.y),
                             (unsigned)(rank / (block.x * block.y))};
            for (long b = 0; b < blocks; b++) {
                blockIdx = dim3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                                (unsigned)(b / ((long)grid.x * grid.y))};
                kernel();
                launch.block_barrier.leave();
                launch.warp_barriers[rank / 32].leave();
                // The last thread out of the block readies the barriers for the next one.
                {
                    std::lock_guard<std::mutex> l(block_done);
                    if (++blocks_done % threads == 0) start_block();
                }
                end_of_block.wait();
            }
        });
    }
    for (auto& t : pool) t.join();
    return 0;
}

template <class... A, size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}
template <class... A>
void call(void (*kernel)(A...), void** args) {
    call(kernel, args, std::index_sequence_for<A...>{});
}

}  // namespace emu

struct EmuConfig {
    unsigned int grid[3], block[3], shared_bytes;
};

// The entry `emu_NAME(config, args)` for kernel NAME, `args` as cuLaunchKernel takes them: a
// pointer to each argument's value. Returns 0, or 1 for a block of no or over 1024 threads.
#define EMU_KERNEL(name)                                                                    \
    extern "C" int emu_##name(const EmuConfig* c, void** args) {                            \
        return emu::run(dim3{c->grid[0], c->grid[1], c->grid[2]},                           \
                        dim3{c->block[0], c->block[1], c->block[2]}, c->shared_bytes,       \
                        [=] { emu::call(name, args); });                                    \
    }
