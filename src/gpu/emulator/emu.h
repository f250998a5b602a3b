// The CUDA C that the engine's kernels use, on the CPU, so that the tests run every kernel
// without a GPU (src/gpu/emulator.rs). Each thread of a block is a fiber on one
// worker thread, which switches fibers at __syncthreads and at the warp shuffles; the blocks
// of a launch are shared among a few worker threads, each with its own shared memory. It
// checks what a kernel computes, not how fast: a GPU still has the last word (its memory
// model, fused multiply-adds, warps running in lockstep).
#pragma once
// Kernels that use what only a GPU has (the tensor cores' mma) take their emulation here.
#define ATTNRES_EMULATOR 1
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
// Each kernel file sits in an unnamed namespace of its own translation unit (emulator.rs), so
// its device functions need no `static` to stay apart from another file's of the same name.
#define __device__
#define __host__
#define __forceinline__
// Shared memory is per block: per worker thread, which runs one block at a time.
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

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

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

#if defined(__x86_64__)
// A fiber's saved stack pointer: switching saves the callee-saved registers on the stack it
// leaves and pops them from the one it enters (emu_switch, in the runtime's own translation
// unit: emulator.rs). No system call, unlike swapcontext, which saves the signal mask.
struct Context {
    void* sp = nullptr;
};
extern "C" void emu_switch(void** save, void* to);
inline void switch_to(Context& from, Context& to) { emu_switch(&from.sp, to.sp); }
// A stack whose first switch "returns" into `entry`, aligned as if `entry` had been called.
inline void start(Context& c, char* stack, size_t bytes, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(stack + bytes)) & ~(uintptr_t)15;
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                             // entry's return address: it never returns
    *--sp = reinterpret_cast<void*>(entry);      // popped by emu_switch's ret
    for (int r = 0; r < 6; r++) *--sp = nullptr;  // rbp, rbx, r12-r15
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void start(Context& c, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = bytes;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// 16 bytes bound for shared memory, read from global memory when the copy was issued.
struct AsyncCopy {
    void* to;
    unsigned char bytes[16];
    long group;
};

struct Fiber {
    Context context;
    char* stack;
    dim3 index;
    int rank;
    State state;
    // Warp exchanges so far in the block: their slots alternate between two sets.
    long exchanges;
    // Asynchronous copies (cp.async) issued and not yet landed, each with its group: the
    // number of groups committed before it was issued.
    std::vector<AsyncCopy> copies;
    long groups_committed;
};

// One worker thread: the fibers of the block it runs, and what they share.
struct Worker {
    const Kernel* kernel;
    Context scheduler;
    std::vector<Fiber> fibers;
    Fiber* current = nullptr;
    // Two sets of one slot per thread, for the warp exchanges.
    std::vector<uint64_t> warp_slots;
    std::vector<unsigned char> dynamic_shared;
    // The blocks run so far, and for each static shared variable the block that last
    // poisoned it.
    long blocks_run = 0;
    std::vector<std::pair<void*, long>> poisoned;
    bool deadlocked = false;
    // A 16-byte access at an address a GPU would fault on ("misaligned address").
    bool misaligned = false;
};

inline thread_local Worker* worker = nullptr;

// A GPU's 16-byte loads, stores and copies need 16-byte aligned addresses; the launch that
// makes one elsewhere is an error.
inline void check_aligned16(const void* p) {
    if (reinterpret_cast<uintptr_t>(p) & 15) worker->misaligned = true;
}

// Static shared memory (a kernel's `__shared__` variables) starts every block as NaN, as
// dynamic shared memory does: the first thread of a block to pass a declaration fills the
// variable with ones (emulator.rs puts EMU_POISON_SHARED after each declaration).
inline void poison_shared(void* at, size_t bytes) {
    Worker* w = worker;
    for (auto& [p, block] : w->poisoned)
        if (p == at) {
            if (block != w->blocks_run) {
                block = w->blocks_run;
                std::memset(at, 0xff, bytes);
            }
            return;
        }
    w->poisoned.emplace_back(at, w->blocks_run);
    std::memset(at, 0xff, bytes);
}
#define EMU_POISON_SHARED(name) emu::poison_shared(&(name), sizeof(name))

// cp.async: between its issue and the wait that must see it (cp.async.wait_group) a copy's
// destination holds no defined value on a GPU, so here it holds NaN (all ones) from the issue
// and the copy lands only at that wait. A read before the wait, or a copy issued into a buffer
// that another warp has yet to finish reading, reads NaN and fails the tests.
inline void copy_async16(void* to, const void* from, bool valid) {
    check_aligned16(to);
    check_aligned16(from);
    AsyncCopy c{to, {}, worker->current->groups_committed};
    if (valid) std::memcpy(c.bytes, from, sizeof c.bytes);
    worker->current->copies.push_back(c);
    std::memset(to, 0xff, sizeof c.bytes);
}
// cp.async.commit_group: the copies issued since the last commit become the newest group.
inline void copies_commit() { worker->current->groups_committed++; }
// cp.async.wait_group: lands every copy but those of the `pending` newest groups and those
// not yet committed to a group.
inline void copies_wait(int pending) {
    Fiber* f = worker->current;
    long landed = f->groups_committed - pending;
    std::vector<AsyncCopy> still;
    for (const AsyncCopy& c : f->copies) {
        if (c.group < landed)
            std::memcpy(c.to, c.bytes, sizeof c.bytes);
        else
            still.push_back(c);
    }
    f->copies.swap(still);
}

inline std::mutex one_launch_at_a_time;
// Room for a kernel's per-thread arrays (attention keeps four of 128 floats).
constexpr size_t STACK_BYTES = 64 << 10;

}  // namespace emu

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// Dynamic shared memory: `DYNAMIC_SHARED(float, buf);` declares `buf`, as
// `extern __shared__ float buf[];` does on a GPU (reduce.cuh defines it there).
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::worker->dynamic_shared.data())

namespace emu {

// The running fiber waits in `state` until the scheduler releases it.
inline void wait(State state) {
    Worker* w = worker;
    Fiber* f = w->current;
    f->state = state;
    switch_to(f->context, w->scheduler);
}

inline void fiber_main() {
    Worker* w = worker;
    (*w->kernel)();
    // A lane that has returned gives no value to a later warp shuffle (undefined on a GPU):
    // its slot of the set the next exchange would use holds all ones, NaN to a kernel that
    // reads it. (No lane still reads that set: all passed the barrier of the exchange since.)
    Fiber* f = w->current;
    size_t half = w->warp_slots.size() / 2;
    w->warp_slots[(f->exchanges & 1) * half + f->rank] = ~uint64_t{0};
    f->state = State::Done;
    // Back to the scheduler, never to return here.
    switch_to(w->current->context, w->scheduler);
}

// Runs the fibers of one warp, lane by lane, releasing its warp barriers as they fill, until
// each has finished or waits at the block's barrier (or at a warp barrier that cannot fill).
inline void run_warp(Worker& w, int first, int end, bool descending) {
    for (;;) {
        for (int i = first; i < end; i++) {
            Fiber& f = w.fibers[descending ? first + end - 1 - i : i];
            if (f.state != State::Runnable) continue;
            w.current = &f;
            threadIdx = f.index;
            switch_to(w.scheduler, f.context);
        }
        int live = 0, at_warp = 0;
        for (int r = first; r < end; r++) {
            live += w.fibers[r].state != State::Done;
            at_warp += w.fibers[r].state == State::AtWarpBarrier;
        }
        if (live == 0 || at_warp < live) return;
        for (int r = first; r < end; r++)
            if (w.fibers[r].state == State::AtWarpBarrier) w.fibers[r].state = State::Runnable;
    }
}

// Runs one block: every fiber until all are done, releasing barriers as they fill. Each warp
// runs alone up to the block's next barrier, warps in ascending order in even blocks and in
// descending order in odd ones (lanes likewise), so that a kernel which reads what another
// warp writes, or overwrites what another warp reads, without a barrier between them does it
// out of order in one of the two. Shared memory starts every block as NaN (all ones), as a
// GPU's holds whatever the last block left (static shared memory: poison_shared).
inline void run_block(Worker& w, bool descending) {
    int n = (int)w.fibers.size();
    w.blocks_run++;
    std::memset(w.dynamic_shared.data(), 0xff, w.dynamic_shared.size());
    for (auto& f : w.fibers) {
        start(f.context, f.stack, STACK_BYTES, fiber_main);
        f.state = State::Runnable;
        f.exchanges = 0;
        f.copies.clear();
        f.groups_committed = 0;
    }
    int warps = (n + 31) / 32;
    for (;;) {
        for (int i = 0; i < warps; i++) {
            int warp = descending ? warps - 1 - i : i;
            run_warp(w, warp * 32, std::min(n, warp * 32 + 32), descending);
        }
        int live = 0, at_block = 0;
        for (auto& f : w.fibers) {
            live += f.state != State::Done;
            at_block += f.state == State::AtBlockBarrier;
        }
        if (live == 0) return;
        if (at_block < live) {
            // Threads wait at barriers that can never fill: a kernel's bug on a GPU too.
            w.deadlocked = true;
            return;
        }
        for (auto& f : w.fibers)
            if (f.state == State::AtBlockBarrier) f.state = State::Runnable;
    }
}

// Runs `kernel` over the grid: blocks shared among worker threads, each block's threads as
// fibers on its worker. Returns 0, 1 for a block of no or over 1024 threads, 2 for threads
// left waiting at a barrier, 3 for a misaligned 16-byte access.
inline int run(const dim3& grid, const dim3& block, unsigned int shared_bytes, const Kernel& kernel) {
    std::lock_guard<std::mutex> one(one_launch_at_a_time);
    int threads = (int)(block.x * block.y * block.z);
    if (threads <= 0 || threads > 1024) return 1;
    long blocks = (long)grid.x * grid.y * grid.z;
    int workers = (int)std::max(1u, std::min(std::thread::hardware_concurrency(), 8u));
    std::atomic<long> next{0};
    std::atomic<bool> deadlocked{false}, misaligned{false};
    auto work = [&] {
        Worker w;
        worker = &w;
        w.kernel = &kernel;
        w.warp_slots.assign((size_t)(threads + 31) / 32 * 32 * 2, 0);
        w.dynamic_shared.resize(shared_bytes);
        w.fibers.resize(threads);
        // Stacks are not zeroed: only the pages a fiber touches are ever backed.
        char* stacks = static_cast<char*>(std::malloc(STACK_BYTES * threads));
        for (int r = 0; r < threads; r++) {
            w.fibers[r].stack = stacks + STACK_BYTES * r;
            w.fibers[r].rank = r;
            w.fibers[r].index = dim3{(unsigned)(r % block.x), (unsigned)(r / block.x % block.y),
                                     (unsigned)(r / (block.x * block.y))};
        }
        blockDim = block;
        gridDim = grid;
        for (long b; (b = next.fetch_add(1)) < blocks && !deadlocked;) {
            blockIdx = dim3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                            (unsigned)(b / ((long)grid.x * grid.y))};
            run_block(w, b % 2 == 1);
            if (w.deadlocked) deadlocked = true;
            if (w.misaligned) misaligned = true;
        }
        std::free(stacks);
        worker = nullptr;
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < std::min<long>(workers, blocks); i++) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    return deadlocked ? 2 : misaligned ? 3 : 0;
}

}  // namespace emu

static inline void __syncthreads() { emu::wait(emu::State::AtBlockBarrier); }
static inline void __syncwarp(unsigned int = 0xffffffffu) { emu::wait(emu::State::AtWarpBarrier); }

// Lane `from(lane)`'s `v`, for every lane of the warp. Consecutive exchanges use alternate
// sets of slots, so one barrier each suffices: a lane writes a set again two exchanges later,
// when every lane has passed the barrier after its reads of it.
template <class T, class F>
static inline T emu_exchange(T v, F from) {
    static_assert(sizeof(T) <= 8);
    emu::Worker* w = emu::worker;
    int rank = w->current->rank;
    int lane = rank % 32, warp = rank / 32;
    uint64_t* slots = w->warp_slots.data() + (w->current->exchanges++ & 1) * (w->warp_slots.size() / 2);
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slots[rank] = bits;
    __syncwarp();
    bits = slots[warp * 32 + from(lane)];
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

namespace emu {

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
// pointer to each argument's value. Returns what emu::run does.
#define EMU_KERNEL(name)                                                                    \
    extern "C" int emu_##name(const EmuConfig* c, void** args) {                            \
        return emu::run(dim3{c->grid[0], c->grid[1], c->grid[2]},                           \
                        dim3{c->block[0], c->block[1], c->block[2]}, c->shared_bytes,       \
                        [=] { emu::call(name, args); });                                    \
    }
