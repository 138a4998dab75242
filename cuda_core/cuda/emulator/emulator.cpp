// The CPU emulator's runtime: fibers, the block scheduler, barriers and warp
// exchanges, shared memory, streams, events and device memory. See
// nanoq_emulator.h for what it checks and why it exists.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "cuda_runtime.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// AddressSanitizer (GCC's __SANITIZE_ADDRESS__, clang's feature test): fiber
// switches are announced to it (stack bounds, fake stacks), device memory's
// canary bytes are poisoned so that any access past a buffer's end is
// reported at once, with the kernel's stack.
#if defined(__SANITIZE_ADDRESS__)
#define NANOQ_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NANOQ_EMU_ASAN 1
#endif
#endif
#if NANOQ_EMU_ASAN
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Under AddressSanitizer, every local whose address is taken (container
// calls' arguments, iterators, a switch's fake_stack) is a stack slot with
// redzones that ASan poisons and clears on each call of the function that
// holds it, inlined callees' slots included: the warp exchange, inlining
// its container work and the fiber switch, had some seventy of them. The
// functions marked NANOQ_EMU_OUT_OF_LINE keep theirs in their own frames
// under ASan (the exchange-heavy emulated tests took half the time); without
// it the compiler inlines as it sees fit.
#if NANOQ_EMU_ASAN
#define NANOQ_EMU_OUT_OF_LINE [[gnu::noinline]]
#else
#define NANOQ_EMU_OUT_OF_LINE
#endif

namespace nanoq_emu {

thread_local const ThreadState* tl_thread = nullptr;
thread_local const BlockView* tl_block = nullptr;

namespace {

// ---- configuration ----------------------------------------------------------
std::uint64_t mix(std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
    const char* text = std::getenv(name);
    if (!text || !*text) return fallback;
    char* end = nullptr;
    const unsigned long long value = std::strtoull(text, &end, 0);
    if (!end || *end) {
        std::fprintf(stderr, "nanoq emulator: ignoring %s=%s (not a number)\n", name, text);
        return fallback;
    }
    return value;
}

std::atomic<bool> seed_overridden{false};
std::atomic<std::uint64_t> seed_override{0};

std::uint64_t the_seed() {
    if (seed_overridden.load()) return seed_override.load();
    static const std::uint64_t seed = [] {
        const char* text = std::getenv("NANOQ_EMU_SEED");
        if (text && *text) return env_u64("NANOQ_EMU_SEED", 0);
        std::random_device device;
        const std::uint64_t s = (static_cast<std::uint64_t>(device()) << 32 | device()) % 1000000007ull;
        std::fprintf(stderr, "nanoq emulator: NANOQ_EMU_SEED unset, using seed %llu\n",
                     static_cast<unsigned long long>(s));
        return s;
    }();
    return seed;
}

int device_count() {
    static const int count = static_cast<int>(env_u64("NANOQ_EMU_DEVICES", 4));
    return count;
}

std::size_t device_memory() {
    static const std::size_t bytes = env_u64("NANOQ_EMU_DEVICE_MEMORY", std::size_t(16) << 30);
    return bytes;
}

constexpr std::size_t kStaticSharedLimit = 48 * 1024;  // without an opt-in, as on every GPU since sm_70
#if NANOQ_EMU_ASAN
constexpr std::size_t kStackBytes = 512 * 1024;  // instrumented frames are larger
#else
constexpr std::size_t kStackBytes = 128 * 1024;
#endif
constexpr std::size_t kCanaryBytes = 4096;  // overruns up to 4 KiB are caught
constexpr unsigned char kCanary = 0xCD;

// ---- context switching ------------------------------------------------------
struct Fiber;
extern "C" void nanoq_emu_fiber_main(Fiber* fiber) __attribute__((visibility("hidden"), used));

#if defined(__x86_64__)
// switch(save, load): saves the callee-saved registers and the stack
// pointer into *save, and resumes `load`. The SSE and x87 control words are
// left alone: kernels never change them, so every fiber shares the thread's.
extern "C" void nanoq_emu_switch(void** save, void* load) __attribute__((visibility("hidden")));
extern "C" void nanoq_emu_trampoline() __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
    .globl nanoq_emu_switch
    .hidden nanoq_emu_switch
    .type nanoq_emu_switch, @function
nanoq_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size nanoq_emu_switch, .-nanoq_emu_switch

    .p2align 4
    .globl nanoq_emu_trampoline
    .hidden nanoq_emu_trampoline
    .type nanoq_emu_trampoline, @function
nanoq_emu_trampoline:
    movq %r12, %rdi
    andq $-16, %rsp
    call nanoq_emu_fiber_main
    ud2
    .size nanoq_emu_trampoline, .-nanoq_emu_trampoline
)");

struct Context {
    void* sp = nullptr;
    const void* stack = nullptr;  // its stack's lowest address and size (for AddressSanitizer)
    std::size_t bytes = 0;
};

void make_context(Context& context, void* stack, std::size_t bytes, Fiber* fiber) {
    context.stack = stack;
    context.bytes = bytes;
    auto top = reinterpret_cast<std::uintptr_t>(stack) + bytes;
    top &= ~std::uintptr_t(15);
    auto* sp = reinterpret_cast<std::uint64_t*>(top);
    *--sp = 0;                                                      // alignment slot
    *--sp = reinterpret_cast<std::uint64_t>(&nanoq_emu_trampoline);  // return address of the first switch
    *--sp = 0;                                                      // rbp
    *--sp = 0;                                                      // rbx
    *--sp = reinterpret_cast<std::uint64_t>(fiber);                 // r12: the trampoline's argument
    *--sp = 0;                                                      // r13
    *--sp = 0;                                                      // r14
    *--sp = 0;                                                      // r15
    context.sp = sp;
}

inline void raw_switch(Context& from, Context& to) { nanoq_emu_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
    const void* stack = nullptr;
    std::size_t bytes = 0;
};

void fiber_entry(unsigned hi, unsigned lo) {
    nanoq_emu_fiber_main(reinterpret_cast<Fiber*>(static_cast<std::uintptr_t>(hi) << 32 | lo));
}

void make_context(Context& context, void* stack, std::size_t bytes, Fiber* fiber) {
    context.stack = stack;
    context.bytes = bytes;
    getcontext(&context.uc);
    context.uc.uc_stack.ss_sp = stack;
    context.uc.uc_stack.ss_size = bytes;
    context.uc.uc_link = nullptr;
    const auto address = reinterpret_cast<std::uintptr_t>(fiber);
    makecontext(&context.uc, reinterpret_cast<void (*)()>(&fiber_entry), 2, static_cast<unsigned>(address >> 32),
                static_cast<unsigned>(address & 0xffffffffu));
}

inline void raw_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// Leaves `from` for `to`; returns when something switches back to `from`.
// `from_done`: `from` is never resumed (AddressSanitizer frees its fake stack).
NANOQ_EMU_OUT_OF_LINE inline void swap_context(Context& from, Context& to, bool from_done = false) {
#if NANOQ_EMU_ASAN
    void* fake_stack = nullptr;
    __sanitizer_start_switch_fiber(from_done ? nullptr : &fake_stack, to.stack, to.bytes);
    raw_switch(from, to);
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
    (void)from_done;
    raw_switch(from, to);
#endif
}

// The first thing a new fiber runs, on its own stack.
inline void fiber_started() {
#if NANOQ_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

// The calling OS thread's own stack, as a Context to switch back to.
inline void thread_stack(Context& context) {
#if NANOQ_EMU_ASAN
    if (context.stack) return;
    pthread_attr_t attr;
    void* lowest = nullptr;
    std::size_t bytes = 0;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        pthread_attr_getstack(&attr, &lowest, &bytes);
        pthread_attr_destroy(&attr);
    }
    context.stack = lowest;
    context.bytes = bytes;
#else
    (void)context;
#endif
}

// Fiber stacks of one OS thread, reused by every block it runs; a guard
// page below each stack turns an overflow into a crash, not corruption.
class StackPool {
public:
    ~StackPool() {
        for (void* s : stacks_) {
#if NANOQ_EMU_ASAN
            // The redzones fibers' frames left poisoned would outlive the
            // mapping: memory mapped there later (a numpy array's, say) would
            // then read as a stack under AddressSanitizer (a false
            // stack-buffer-underflow, seen in a CI run).
            ASAN_UNPOISON_MEMORY_REGION(s, kStackBytes);
#endif
            munmap(static_cast<char*>(s) - page(), kStackBytes + page());
        }
    }
    void* get(std::size_t i) {
        while (stacks_.size() <= i) {
            void* base = mmap(nullptr, kStackBytes + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                              -1, 0);
            if (base == MAP_FAILED) throw Error("emulator: cannot map a fiber stack");
            mprotect(base, page(), PROT_NONE);
            stacks_.push_back(static_cast<char*>(base) + page());
            abandoned_.push_back(false);
        }
#if NANOQ_EMU_ASAN
        // AddressSanitizer poisons the redzones of live frames. A fiber
        // that finished left only its entry frames live, at the top, where
        // the next fiber's entry frames fall the same way; one left
        // suspended (a failed block) may have left them anywhere.
        constexpr std::size_t kEntryBytes = 16 * 1024;
        char* stack = static_cast<char*>(stacks_[i]);
        if (abandoned_[i]) ASAN_UNPOISON_MEMORY_REGION(stack, kStackBytes);
        else ASAN_UNPOISON_MEMORY_REGION(stack + kStackBytes - kEntryBytes, kEntryBytes);
#endif
        abandoned_[i] = false;
        return stacks_[i];
    }
    // Stack i's fiber never finished (its block failed).
    void abandon(std::size_t i) { abandoned_[i] = true; }

private:
    static std::size_t page() {
        static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
        return size;
    }
    std::vector<void*> stacks_;
    std::vector<bool> abandoned_;
};

// ---- a running block --------------------------------------------------------
enum class Status { Runnable, AtBarrier, InWarp, Done };

struct Exchange {
    WarpOp op;
    unsigned mask = 0, arrived = 0;
    int readers = 0;
    const char* what = "";
    std::uint64_t values[32];
};

struct Fiber {
    Context context;
    ThreadState state;
    Status status = Status::Runnable;
    int warp = 0, lane = 0;
};

struct WarpState {
    unsigned existing = 0, exited = 0;
    std::vector<Exchange*> pending;
};

struct Launch {
    GridArg grid;
    dim3 block;
    std::size_t dynamic_shared;
    std::function<void()> body;
    std::uint64_t sequence;
};

std::string dims(const dim3& d) {
    return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

class BlockRun {
public:
    void run(const Launch& launch, uint3 block_idx, StackPool& stacks);

    // Called from fibers:
    int barrier(int predicate, const char* what, const char* file, int line);
    const std::uint64_t* exchange(WarpOp op, unsigned mask, std::uint64_t value, const char* what);
    [[noreturn]] void fail_exchange(const char* what, unsigned mask, const char* other);
    Exchange* open_exchange(WarpState& warp, WarpOp op, unsigned mask, const char* what);
    void complete_exchange(WarpState& warp, Exchange* x);
    void* static_shared(const void* tag, std::size_t bytes, std::size_t align, const char* name);
    void* dynamic_shared(std::size_t* bytes) {
        *bytes = launch_->dynamic_shared;
        return dynamic_.data();
    }
    void fiber_main(Fiber* fiber);
    [[noreturn]] void fail(const std::string& message) { throw Error(message); }
    int lane() const { return current_->lane; }

private:
    NANOQ_EMU_OUT_OF_LINE void block_on(Status status) {
        current_->status = status;
        switch_away(current_->context);
    }
    // Leaves the current fiber (saving it in `from`) for a runnable one
    // picked at random, or for the scheduler when none is left (or the
    // block failed). Fiber to fiber directly: half the switches.
    void switch_away(Context& from, bool from_done = false) {
        if (failed_ || nothing_runnable()) {
            swap_context(from, scheduler_, from_done);
            return;
        }
        Fiber* next = pick();
        swap_context(from, next->context, from_done);
    }
    bool nothing_runnable() const { return by_warp_ ? ready_warps_ == 0 : runnable_.empty(); }
    static int take_random(std::vector<int>& list, std::uint64_t random) {
        const std::size_t at = random % list.size();
        const int index = list[at];
        list[at] = list.back();
        list.pop_back();
        return index;
    }
    // Two schedules, chosen per block from the seed. Uniform: any runnable
    // thread next, so warps advance nearly in step and fine interleavings
    // show. By warp: a random ranking of the warps, and a thread of the
    // best-ranked warp that can run goes next, so one warp races as far
    // ahead of the others as the barriers let it (a missing barrier between
    // a shared-memory write and another warp's read shows at once).
    Fiber* pick() {
        int index;
        if (by_warp_) {
            const int rank = __builtin_ctzll(ready_warps_);
            std::vector<int>& list = warp_runnable_[warp_by_rank_[rank]];
            index = take_random(list, next_random());
            if (list.empty()) ready_warps_ &= ~(std::uint64_t(1) << rank);
        } else {
            index = take_random(runnable_, next_random());
        }
        current_ = &fibers_[index];
        tl_thread = &current_->state;
        return current_;
    }
    void wake(Fiber& f) {
        f.status = Status::Runnable;
        const int index = static_cast<int>(&f - fibers_.data());
        if (by_warp_) {
            warp_runnable_[f.warp].push_back(index);
            ready_warps_ |= std::uint64_t(1) << rank_of_warp_[f.warp];
        } else {
            runnable_.push_back(index);
        }
    }
    void on_exit(Fiber& f);
    std::string where(const Fiber& f) const;
    std::string deadlock() const;
    std::string context_line() const;

    const Launch* launch_ = nullptr;
    BlockView view_{};
    int threads_ = 0, exited_ = 0;
    std::vector<Fiber> fibers_;
    std::vector<int> runnable_;
    bool by_warp_ = false;
    std::vector<std::vector<int>> warp_runnable_;
    std::vector<int> warp_by_rank_, rank_of_warp_;
    std::uint64_t ready_warps_ = 0;  // bit r: the warp ranked r has a runnable thread
    std::vector<WarpState> warps_;
    std::deque<Exchange> exchange_storage_;
    std::vector<Exchange*> free_exchanges_;
    Context scheduler_;
    Fiber* current_ = nullptr;
    std::uint64_t rng_ = 0;
    // barrier
    int arrived_ = 0, count_ = 0;
    unsigned generation_ = 0;
    int results_[2] = {0, 0};
    const char* barrier_what_ = nullptr;
    const char* barrier_file_ = nullptr;
    int barrier_line_ = 0;
    // shared memory
    alignas(64) unsigned char static_arena_[kStaticSharedLimit];
    std::size_t static_used_ = 0;
    std::vector<std::pair<const void*, std::size_t>> static_vars_;
    std::vector<unsigned char> dynamic_;
    // failure
    bool failed_ = false;
    std::string error_;

    std::uint64_t next_random() {
        rng_ += 0x9E3779B97F4A7C15ull;
        return mix(rng_);
    }
};

thread_local BlockRun* tl_run = nullptr;

std::string BlockRun::context_line() const {
    return "kernel launched at " + std::string(launch_->grid.file) + ":" + std::to_string(launch_->grid.line) +
           ", grid " + dims(launch_->grid.grid) + ", block " + dims(launch_->block) + ", emulator seed " +
           std::to_string(the_seed());
}

std::string BlockRun::where(const Fiber& f) const {
    const uint3& t = f.state.thread_idx;
    const uint3& b = view_.block_idx;
    return "thread (" + std::to_string(t.x) + ", " + std::to_string(t.y) + ", " + std::to_string(t.z) +
           ") of block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ", " + std::to_string(b.z) + ")";
}

void BlockRun::run(const Launch& launch, uint3 block_idx, StackPool& stacks) {
    launch_ = &launch;
    view_ = BlockView{block_idx, launch.block, launch.grid.grid};
    threads_ = static_cast<int>(launch.block.x * launch.block.y * launch.block.z);
    exited_ = arrived_ = count_ = 0;
    generation_ = 0;
    failed_ = false;
    error_.clear();
    static_used_ = 0;
    static_vars_.clear();
    dynamic_.assign(launch.dynamic_shared, 0xff);
    rng_ = mix(the_seed() ^ mix(launch.sequence) ^
               mix((static_cast<std::uint64_t>(block_idx.z) << 42) ^ (static_cast<std::uint64_t>(block_idx.y) << 21) ^
                   block_idx.x));
    const int warps = (threads_ + 31) / 32;
    warps_.assign(warps, WarpState{});
    for (int w = 0; w < warps; ++w) {
        const int lanes = std::min(32, threads_ - 32 * w);
        warps_[w].existing = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    }
    free_exchanges_.clear();
    for (Exchange& x : exchange_storage_) free_exchanges_.push_back(&x);

    fibers_.resize(threads_);
    runnable_.clear();
    by_warp_ = warps > 1 && (next_random() & 1);
    warp_runnable_.assign(warps, {});
    warp_by_rank_.resize(warps);
    rank_of_warp_.resize(warps);
    for (int w = 0; w < warps; ++w) warp_by_rank_[w] = w;
    for (int w = warps; w > 1; --w) std::swap(warp_by_rank_[w - 1], warp_by_rank_[next_random() % w]);
    for (int r = 0; r < warps; ++r) rank_of_warp_[warp_by_rank_[r]] = r;
    ready_warps_ = 0;
    for (int i = 0; i < threads_; ++i) {
        Fiber& f = fibers_[i];
        const unsigned bx = launch.block.x, by = launch.block.y;
        f.state.thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
        f.state.linear = i;
        f.status = Status::Runnable;
        f.warp = i / 32;
        f.lane = i % 32;
        make_context(f.context, stacks.get(i), kStackBytes, &f);
        wake(f);
    }

    thread_stack(scheduler_);
    tl_run = this;
    tl_block = &view_;
    // Fibers pass control among themselves and come back here when none is
    // runnable: every thread finished, a deadlock, or a failure.
    if (!nothing_runnable()) swap_context(scheduler_, pick()->context);
    tl_thread = nullptr;
    current_ = nullptr;
    for (int i = 0; i < threads_; ++i)
        if (fibers_[i].status != Status::Done) stacks.abandon(i);
    if (failed_) throw Error(error_);
    if (exited_ < threads_) throw Error("deadlock: " + deadlock() + " (block (" + std::to_string(block_idx.x) + ", " +
                                        std::to_string(block_idx.y) + ", " + std::to_string(block_idx.z) + "), " +
                                        context_line() + ")");
}

std::string BlockRun::deadlock() const {
    std::ostringstream out;
    int at_barrier = 0, in_warp = 0;
    for (const Fiber& f : fibers_) {
        if (f.status == Status::AtBarrier) ++at_barrier;
        if (f.status == Status::InWarp) ++in_warp;
    }
    out << threads_ - exited_ << " of " << threads_ << " threads never finish";
    if (at_barrier)
        out << "; " << at_barrier << " wait at " << barrier_what_ << " at " << barrier_file_ << ":" << barrier_line_;
    for (std::size_t w = 0; w < warps_.size(); ++w)
        for (const Exchange* x : warps_[w].pending)
            out << "; warp " << w << " lanes 0x" << std::hex << x->arrived << " wait in " << x->what << " for lanes 0x"
                << (x->mask & ~x->arrived) << std::dec;
    return out.str();
}

void BlockRun::fiber_main(Fiber* fiber) {
    fiber_started();
    try {
        launch_->body();
        on_exit(*fiber);
    } catch (const std::exception& e) {
        if (!failed_) {
            failed_ = true;
            error_ = std::string(e.what()) + " (" + where(*fiber) + ", " + context_line() + ")";
        }
    }
    fiber->status = Status::Done;
    switch_away(fiber->context, true);
    std::abort();  // a finished fiber is never resumed
}

void BlockRun::on_exit(Fiber& f) {
    ++exited_;
    warps_[f.warp].exited |= 1u << f.lane;
    if (arrived_ > 0)
        fail(std::string(barrier_what_) + " at " + barrier_file_ + ":" + std::to_string(barrier_line_) +
             " is not reached by every thread: a thread exits while " + std::to_string(arrived_) + " wait there");
    for (const Exchange* x : warps_[f.warp].pending)
        if (x->mask >> f.lane & 1u)
            fail("lane " + std::to_string(f.lane) + " exits while lanes wait for it in " + x->what);
}

int BlockRun::barrier(int predicate, const char* what, const char* file, int line) {
    if (exited_ > 0)
        fail(std::string(what) + " at " + file + ":" + std::to_string(line) + " is not reached by every thread: " +
             std::to_string(exited_) + " of " + std::to_string(threads_) + " threads of the block have exited");
    if (arrived_ == 0) {
        barrier_what_ = what;
        barrier_file_ = file;
        barrier_line_ = line;
        count_ = 0;
    } else if (line != barrier_line_ || std::strcmp(file, barrier_file_) != 0) {
        fail("threads of one block wait at different barriers: " + std::string(what) + " at " + file + ":" +
             std::to_string(line) + " and " + barrier_what_ + " at " + barrier_file_ + ":" +
             std::to_string(barrier_line_));
    }
    count_ += predicate;
    ++arrived_;
    Fiber* self = current_;
    const unsigned generation = generation_;
    if (arrived_ == threads_) {
        results_[generation & 1u] = count_;
        arrived_ = 0;
        ++generation_;
        for (Fiber& f : fibers_)
            if (f.status == Status::AtBarrier) wake(f);
    } else {
        block_on(Status::AtBarrier);
    }
    return results_[generation & 1u];
}

// The misuses exchange() reports, worded out of line (their strings' slots;
// see NANOQ_EMU_OUT_OF_LINE).
[[noreturn, gnu::noinline, gnu::cold]] void BlockRun::fail_exchange(const char* what, unsigned mask,
                                                                    const char* other) {
    auto hex = [](unsigned m) {
        char text[16];
        std::snprintf(text, sizeof(text), "0x%08x", m);
        return std::string(text);
    };
    const WarpState& warp = warps_[current_->warp];
    if (other) fail("lanes of one warp are in different intrinsics: " + std::string(what) + " and " + other);
    if (!(mask & (1u << current_->lane)))
        fail(std::string(what) + ": mask " + hex(mask) + " leaves out the calling lane " +
             std::to_string(current_->lane));
    if (mask & ~warp.existing)
        fail(std::string(what) + ": mask " + hex(mask) + " names lanes " + hex(mask & ~warp.existing) +
             " that this block (" + std::to_string(threads_) + " threads) does not have");
    fail(std::string(what) + ": mask " + hex(mask) + " names lanes " + hex(mask & warp.exited) + " that have exited");
}

const std::uint64_t* BlockRun::exchange(WarpOp op, unsigned mask, std::uint64_t value, const char* what) {
    Fiber* self = current_;
    WarpState& warp = warps_[self->warp];
    const unsigned bit = 1u << self->lane;
    if (!(mask & bit) || (mask & ~warp.existing) || (mask & warp.exited)) fail_exchange(what, mask, nullptr);
    Exchange* x = nullptr;
    // Lanes of other masks may still wait in an earlier exchange (they join
    // this one when it completes); a cycle of such waits is a deadlock,
    // which the scheduler reports.
    Exchange* const* pending = warp.pending.data();
    for (std::size_t i = 0, n = warp.pending.size(); i < n; ++i) {
        if (pending[i]->mask == mask && !(pending[i]->arrived & bit)) {
            x = pending[i];
            break;
        }
    }
    if (!x) x = open_exchange(warp, op, mask, what);
    if (x->op != op) fail_exchange(what, mask, x->what);
    x->values[self->lane] = value;
    x->arrived |= bit;
    if (x->arrived == mask)
        complete_exchange(warp, x);
    else
        block_on(Status::InWarp);
    // The caller reads the values before any other fiber runs, so the
    // record may be handed back now; it is reused only by a later exchange.
    if (--x->readers == 0) free_exchanges_.push_back(x);
    return x->values;
}

// exchange()'s container work (out of line under ASan: NANOQ_EMU_OUT_OF_LINE).
NANOQ_EMU_OUT_OF_LINE Exchange* BlockRun::open_exchange(WarpState& warp, WarpOp op, unsigned mask, const char* what) {
    if (free_exchanges_.empty()) {
        exchange_storage_.emplace_back();
        free_exchanges_.push_back(&exchange_storage_.back());
    }
    Exchange* x = free_exchanges_.back();
    free_exchanges_.pop_back();
    x->op = op;
    x->mask = mask;
    x->arrived = 0;
    x->what = what;
    warp.pending.push_back(x);
    return x;
}

// The last lane of `x` arrived: the others wake to read the values.
NANOQ_EMU_OUT_OF_LINE void BlockRun::complete_exchange(WarpState& warp, Exchange* x) {
    x->readers = __builtin_popcount(x->mask);
    warp.pending.erase(std::find(warp.pending.begin(), warp.pending.end(), x));
    const int first = current_->warp * 32;
    for (int lane = 0; lane < 32; ++lane)
        if ((x->mask >> lane & 1u) && lane != current_->lane) wake(fibers_[first + lane]);
}

void* BlockRun::static_shared(const void* tag, std::size_t bytes, std::size_t align, const char* name) {
    for (const auto& var : static_vars_)
        if (var.first == tag) return static_arena_ + var.second;
    const std::size_t offset = (static_used_ + align - 1) / align * align;
    if (offset + bytes + launch_->dynamic_shared > kStaticSharedLimit)
        fail("shared memory of the block exceeds " + std::to_string(kStaticSharedLimit) + " bytes at `" + name + "` (" +
             std::to_string(offset + bytes) + " static + " + std::to_string(launch_->dynamic_shared) + " dynamic)");
    std::memset(static_arena_ + offset, 0xff, bytes);
    static_used_ = offset + bytes;
    static_vars_.emplace_back(tag, offset);
    return static_arena_ + offset;
}

// ---- device memory ------------------------------------------------------------
struct Allocation {
    std::size_t bytes;
    int device;           // -1: pinned host memory
    bool pooled = false;  // freed by cudaFreeAsync, still held by the device's memory pool
};

class Memory {
public:
    void* allocate(std::size_t bytes, int device) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (device >= 0 && used_[device] + bytes > device_memory()) return nullptr;
        const std::size_t padded = (bytes + kCanaryBytes + 255) / 256 * 256;
        void* data = std::aligned_alloc(256, padded);
        if (!data) return nullptr;
        std::memset(data, 0xA5, bytes);  // fresh device memory holds garbage
        std::memset(static_cast<char*>(data) + bytes, kCanary, padded - bytes);
#if NANOQ_EMU_ASAN
        // Any access to the canaries is then an AddressSanitizer report (a
        // read too, which the canaries alone cannot see), at the access.
        ASAN_POISON_MEMORY_REGION(static_cast<char*>(data) + bytes, padded - bytes);
#endif
        allocations_[data] = Allocation{bytes, device};
        if (device >= 0) used_[device] += bytes;
        return data;
    }

    // The allocation's canary status; throws for pointers it never gave out.
    void release(void* data, bool pinned) {
        std::string broken;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = allocations_.find(data);
            if (it == allocations_.end() || (it->second.device < 0) != pinned || it->second.pooled)
                throw Error(std::string(pinned ? "cudaFreeHost" : "cudaFree") +
                            " of a pointer that is not a live allocation of that kind");
            broken = canary_report(it->first, it->second);
            if (it->second.device >= 0) used_[it->second.device] -= it->second.bytes;
            allocations_.erase(it);
        }
        std::free(data);
        if (!broken.empty()) throw Error(broken);
    }

    // The first broken canary among the live allocations, or "".
    std::string check() {
#if NANOQ_EMU_ASAN
        return "";  // see canary_report
#endif
        std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& entry : allocations_) {
            std::string broken = canary_report(entry.first, entry.second);
            if (!broken.empty()) {
                // Restore it so that one overrun is reported once.
                const std::size_t padded = (entry.second.bytes + kCanaryBytes + 255) / 256 * 256;
                std::memset(static_cast<char*>(entry.first) + entry.second.bytes, kCanary, padded - entry.second.bytes);
                return broken;
            }
        }
        return "";
    }

    // Whether [p, p + bytes) lies in pinned or device memory given out here.
    bool registered(const void* p) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = allocations_.upper_bound(const_cast<void*>(p));
        if (it == allocations_.begin()) return false;
        --it;
        const char* base = static_cast<const char*>(it->first);
        return static_cast<const char*>(p) < base + it->second.bytes + kCanaryBytes;
    }

    std::size_t used(int device) {
        std::lock_guard<std::mutex> lock(mutex_);
        return used_[device];
    }

    // The device's memory pool (cudaMallocAsync/cudaFreeAsync), as on a GPU
    // with the default release threshold of 0: a block freed in stream order
    // stays with the pool, still taken from the device, until the pool is
    // trimmed (cudaMemPoolTrimTo) or a stream, event or device
    // synchronisation hands it back; a later cudaMallocAsync of the same
    // size takes it again.
    void pool(void* data) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = allocations_.find(data);
        if (it == allocations_.end() || it->second.device < 0 || it->second.pooled)
            throw Error("cudaFreeAsync of a pointer that is not a live device allocation");
        it->second.pooled = true;
    }

    void* take_pooled(std::size_t bytes, int device) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [data, a] : allocations_)
            if (a.pooled && a.device == device && a.bytes == bytes) {
                a.pooled = false;
                std::memset(data, 0xA5, bytes);  // what the pool hands out is garbage again
                return data;
            }
        return nullptr;
    }

    // Frees the pooled blocks of `device` until at most `keep` bytes stay pooled.
    void trim(int device, std::size_t keep) {
        std::vector<void*> released;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            std::size_t held = 0;
            for (const auto& [data, a] : allocations_)
                if (a.pooled && a.device == device) held += a.bytes;
            for (auto& [data, a] : allocations_)
                if (held > keep && a.pooled && a.device == device) {
                    held -= a.bytes;
                    a.pooled = false;
                    released.push_back(data);
                }
        }
        for (void* data : released) release(data, false);
    }

private:
    static std::string canary_report(const void* data, const Allocation& a) {
#if NANOQ_EMU_ASAN
        (void)data, (void)a;
        return "";  // poisoned: AddressSanitizer reported any access when it happened
#endif
        const auto* tail = static_cast<const unsigned char*>(data) + a.bytes;
        const std::size_t padded = (a.bytes + kCanaryBytes + 255) / 256 * 256;
        for (std::size_t i = 0; i < padded - a.bytes; ++i)
            if (tail[i] != kCanary)
                return "out-of-bounds write: byte " + std::to_string(i) + " past the end of a " +
                       std::to_string(a.bytes) + "-byte " + (a.device < 0 ? "pinned host" : "device") +
                       " buffer was overwritten";
        return "";
    }

    std::mutex mutex_;
    std::map<void*, Allocation> allocations_;
    std::map<int, std::size_t> used_;
};

Memory& memory() {
    static Memory* m = new Memory();  // outlives every static destructor that may free
    return *m;
}

// ---- errors ---------------------------------------------------------------------
thread_local cudaError_t tl_last_error = cudaSuccess;  // cudaGetLastError()
thread_local cudaError_t tl_message_code = cudaSuccess;
thread_local std::string tl_message;
thread_local int tl_device = 0;

cudaError_t report(cudaError_t code, const std::string& message) {
    tl_message_code = code;
    tl_message = message;
    return code;
}

cudaError_t launch_error(cudaError_t code, const std::string& message) {
    tl_last_error = code;
    return report(code, message);
}

// ---- compute capability and the build's architectures -------------------------------
// The emulated devices' compute capability, 10 * major + minor: 90 (Hopper),
// or NANOQ_EMU_COMPUTE_CAPABILITY ("8.0", "10.0", ...), read at each call.
int compute_capability() {
    const char* text = std::getenv("NANOQ_EMU_COMPUTE_CAPABILITY");
    if (!text || !*text) return 90;
    int major = 0, minor = 0;
    char tail = 0;
    if (std::sscanf(text, "%d.%d%c", &major, &minor, &tail) != 2 || major < 1 || minor < 0 || minor > 9) {
        std::fprintf(stderr, "nanoq emulator: ignoring NANOQ_EMU_COMPUTE_CAPABILITY=%s (not MAJOR.MINOR)\n", text);
        return 90;
    }
    return 10 * major + minor;
}

// Whether the emulated build has code that the devices can run, by CUDA's
// rule for architectures built as "XY" (sm_XY code, which runs on XY up to
// the next major version, and compute_XY PTX, which the driver compiles for
// any newer GPU): one of NANOQ_CUDA_ARCHITECTURES ("90", "80,90") at or
// below the device's capability. "" when it has, else why not.
std::string missing_kernel_image() {
    const int device = compute_capability();
    const std::string built = NANOQ_CUDA_ARCHITECTURES;
    std::size_t at = 0;
    while (at < built.size()) {
        const std::size_t comma = std::min(built.find(',', at), built.size());
        if (std::atoi(built.substr(at, comma - at).c_str()) <= device) return "";
        at = comma + 1;
    }
    return "no kernel image for a device of compute capability " + std::to_string(device / 10) + "." +
           std::to_string(device % 10) + " (the emulated build is for CUDA architectures " + built + ")";
}

// ---- injected device loss (nanoq_emu_lose_device, for tests) -----------------------
// A GPU can fail for good in the middle of work (an Xid: a fatal fault, the
// device falling off the bus): its context is lost, every later operation on
// any of its streams and every later call on it fail with a sticky error,
// and work of other devices that waits for it (a collective) waits for ever.
// Tests inject that to check how multi-device code fails.
constexpr int kMaxLosableDevices = 64;
struct DeviceFault {
    std::atomic<long> kernels_left{0};  // > 0: the device is lost when its kernels_left-th next kernel runs
    std::atomic<bool> lost{false};
};
DeviceFault* device_fault(int device) {
    static DeviceFault faults[kMaxLosableDevices];
    return device >= 0 && device < kMaxLosableDevices ? &faults[device] : nullptr;
}

std::string lost_message(int device) {
    return "emulated device " + std::to_string(device) + " was lost (injected with nanoq_emu_lose_device)";
}

// Counts a kernel that is about to run on `device`; throws if it is the one
// the device is lost at.
void count_kernel(int device, const Launch& launch) {
    DeviceFault* f = device_fault(device);
    if (!f || f->kernels_left.load() <= 0 || f->kernels_left.fetch_sub(1) != 1) return;
    f->lost = true;
    throw Error(lost_message(device) + " running the kernel launched at " + launch.grid.file + ":" +
                std::to_string(launch.grid.line));
}

// cudaSuccess, or the sticky error of a lost device (for calls on it).
cudaError_t check_device(int device) {
    return device_lost(device) ? report(cudaErrorLaunchFailure, lost_message(device)) : cudaSuccess;
}

// Host-to-device copies from pageable memory (nanoq_emu_pageable_copies).
std::atomic<unsigned long long> pageable_copies{0};

}  // namespace

void jitter() {
    static const std::uint64_t most = env_u64("NANOQ_EMU_JITTER_US", 0);
    if (most == 0) return;
    // Per thread, from the clock (not the seed: the point is to vary the
    // interleaving from run to run); a quarter of the calls sleep.
    thread_local std::uint64_t state =
        mix(std::uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
            std::hash<std::thread::id>()(std::this_thread::get_id()));
    state = mix(state);
    if (state % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds((state >> 8) % most));
}

bool device_lost(int device) {
    const DeviceFault* f = device_fault(device);
    return f && f->lost.load();
}

namespace {
std::mutex stall_mutex;
std::condition_variable stall_changed;
int stalled_device = -1;

// Blocks a query of unfinished work from the stopped host (as a process
// stuck waiting) until it is released (120 s at most, so that a test
// cannot hang the machine).
void wait_if_stalled() {
    std::unique_lock<std::mutex> lock(stall_mutex);
    if (stalled_device != tl_device) return;
    stall_changed.wait_for(lock, std::chrono::seconds(120), [] { return stalled_device != tl_device; });
}
}  // namespace

void stall_host(int device) {
    std::lock_guard<std::mutex> lock(stall_mutex);
    stalled_device = device;
}

void release_stalled_host() {
    std::lock_guard<std::mutex> lock(stall_mutex);
    stalled_device = -1;
    stall_changed.notify_all();
}

// ---- stream capture ------------------------------------------------------------------
// One recorded operation of a capture: its work and the earlier nodes it
// waits for (the stream order and the events waited on during the capture).
struct GraphNode {
    std::function<void()> work;
    const char* what;
    std::vector<std::size_t> deps;
};

// A capture in progress, begun on `origin`; `members` are the streams in it
// (origin first, then those that joined by waiting on a captured event).
struct Capture {
    std::vector<GraphNode> nodes;
    int device;
    cudaStreamCaptureMode mode;
    std::thread::id thread;
    cudaStream_t origin;
    std::vector<cudaStream_t> members;
    bool active = true;
    bool invalidated = false;
    std::string why;  // the first call that invalidated it
};

namespace {
// Guards the capture state of every stream, event and capture.
std::mutex capture_mutex;
std::vector<std::shared_ptr<Capture>>& active_captures() {
    static auto* captures = new std::vector<std::shared_ptr<Capture>>();
    return *captures;
}
std::atomic<unsigned long long> graphs_captured{0}, graphs_launched{0};

// Marks `c` invalid, keeping the first reason; capture_mutex held.
void invalidate(Capture& c, const std::string& why) {
    if (c.invalidated) return;
    c.invalidated = true;
    c.why = why;
}

const char* mode_name(cudaStreamCaptureMode mode) {
    switch (mode) {
        case cudaStreamCaptureModeGlobal: return "global";
        case cudaStreamCaptureModeThreadLocal: return "thread-local";
        case cudaStreamCaptureModeRelaxed: return "relaxed";
    }
    return "?";
}
}  // namespace

// ---- streams and events ------------------------------------------------------------
}  // namespace nanoq_emu

struct nanoq_emu_graph {
    std::vector<nanoq_emu::GraphNode> nodes;
    int device;
};

struct nanoq_emu_graph_exec {
    std::shared_ptr<const std::vector<nanoq_emu::GraphNode>> nodes;
    std::atomic<std::uint64_t> launches{0};
};

struct nanoq_emu_stream {
    struct Task {
        std::function<void()> work;
        const char* what;
        bool always;  // event records and waits run even on a failed stream
    };

    explicit nanoq_emu_stream(int dev) : device(dev) { worker = std::thread([this] { drain(); }); }

    // Threads in synchronize_device waiting on this stream (guarded by
    // streams_mutex): cudaStreamDestroy on another thread waits for them
    // before it deletes the stream.
    int pins = 0;

    ~nanoq_emu_stream() {
        {
            std::lock_guard<std::mutex> lock(mutex);
            stop = true;
        }
        ready.notify_all();
        worker.join();
    }

    void push(std::function<void()> work, const char* what, bool always = false) {
        if (record_if_captured(work, what)) return;
        {
            std::lock_guard<std::mutex> lock(mutex);
            tasks.push_back(Task{std::move(work), what, always});
        }
        ready.notify_one();
    }

    // While the stream is in a capture, its work is recorded there (after
    // the stream's frontier, the capture's latest nodes it is ordered after)
    // instead of queued; an invalidated capture records nothing more.
    bool record_if_captured(std::function<void()>& work, const char* what) {
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        if (!capture) return false;
        if (!capture->invalidated) {
            capture->nodes.push_back(nanoq_emu::GraphNode{std::move(work), what, frontier});
            frontier.assign(1, capture->nodes.size() - 1);
        }
        return true;
    }

    // Waits for every queued task; returns the sticky error (and its message).
    cudaError_t synchronize(std::string* message) {
        std::unique_lock<std::mutex> lock(mutex);
        idle.wait(lock, [this] { return tasks.empty() && !busy; });
        return sticky(message);
    }

    // cudaErrorNotReady while work is queued, else the sticky error (as
    // cudaStreamQuery reports errors of earlier asynchronous work).
    cudaError_t query(std::string* message) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!tasks.empty() || busy) return cudaErrorNotReady;
        return sticky(message);
    }

    void drain() {
        nanoq_emu::tl_device = device;
        for (;;) {
            Task task;
            {
                std::unique_lock<std::mutex> lock(mutex);
                ready.wait(lock, [this] { return stop || !tasks.empty(); });
                if (tasks.empty()) return;
                task = std::move(tasks.front());
                tasks.pop_front();
                busy = true;
                if (error == cudaSuccess && !task.always && nanoq_emu::device_lost(device)) {
                    error = cudaErrorLaunchFailure;
                    message = std::string(task.what) + ": " + nanoq_emu::lost_message(device);
                }
                if (error != cudaSuccess && !task.always) {
                    busy = false;
                    if (tasks.empty()) idle.notify_all();
                    continue;
                }
            }
            cudaError_t code = cudaSuccess;
            std::string text;
            nanoq_emu::jitter();
            try {
                task.work();
            } catch (const std::exception& e) {
                code = cudaErrorLaunchFailure;
                text = std::string(task.what) + ": " + e.what();
            }
            std::lock_guard<std::mutex> lock(mutex);
            if (code != cudaSuccess && error == cudaSuccess) {
                error = code;
                message = text;
            }
            busy = false;
            if (tasks.empty()) idle.notify_all();
        }
    }

    // The stream's error, or its device's loss; called with `mutex` held.
    cudaError_t sticky(std::string* text) {
        if (error == cudaSuccess && nanoq_emu::device_lost(device)) {
            error = cudaErrorLaunchFailure;
            message = nanoq_emu::lost_message(device);
        }
        *text = message;
        return error;
    }

    int device;
    std::uint64_t launches = 0;  // host-side count, for the schedule's seed
    std::mutex mutex;
    std::condition_variable ready, idle;
    std::deque<Task> tasks;
    bool busy = false, stop = false;
    cudaError_t error = cudaSuccess;
    std::string message;
    // The capture the stream is in and its frontier there (capture_mutex).
    std::shared_ptr<nanoq_emu::Capture> capture;
    std::vector<std::size_t> frontier;
    std::thread worker;
};

struct nanoq_emu_event {
    std::mutex mutex;
    std::condition_variable done;
    std::uint64_t recorded = 0, completed = 0;
    bool timing = true;  // not cudaEventDisableTiming
    // When the stream reached the latest completed record (cudaEventElapsedTime).
    std::chrono::steady_clock::time_point completed_at{};
    // Set when the latest record was in a capture: its nodes then (capture_mutex).
    std::shared_ptr<nanoq_emu::Capture> capture;
    std::vector<std::size_t> capture_nodes;
};

namespace nanoq_emu {
namespace {

std::mutex streams_mutex;
std::condition_variable streams_unpinned;  // a stream's pins fell to 0
std::vector<cudaStream_t>& live_streams() {
    static auto* streams = new std::vector<cudaStream_t>();
    return *streams;
}

cudaStream_t resolve(cudaStream_t stream) {
    if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
        // The default stream; never destroyed (its worker ends with the process).
        static cudaStream_t fallback = [] {
            auto* s = new nanoq_emu_stream(0);
            std::lock_guard<std::mutex> lock(streams_mutex);
            live_streams().push_back(s);
            return s;
        }();
        return fallback;
    }
    return stream;
}

// Waits for every stream of `device` (-1: all); the first error wins.
cudaError_t synchronize_device(int device) {
    // Pinned, so that another thread may destroy one of them meanwhile (it
    // waits for the pin; as on a GPU, its queued work completes first).
    std::vector<cudaStream_t> streams;
    {
        std::lock_guard<std::mutex> lock(streams_mutex);
        for (cudaStream_t s : live_streams())
            if (device < 0 || s->device == device) {
                ++s->pins;
                streams.push_back(s);
            }
    }
    cudaError_t first = cudaSuccess;
    std::string text;
    for (cudaStream_t s : streams) {
        std::string message;
        const cudaError_t code = s->synchronize(&message);
        if (code != cudaSuccess && first == cudaSuccess) {
            first = code;
            text = message;
        }
        std::lock_guard<std::mutex> lock(streams_mutex);
        if (--s->pins == 0) streams_unpinned.notify_all();
    }
    return first == cudaSuccess ? cudaSuccess : report(first, text);
}

// cudaErrorStreamCaptureUnsupported when `what`, a call that may
// synchronise implicitly, is forbidden by a capture in progress: by any
// global-mode capture, or by a thread-local one begun on this thread. Those
// captures are invalidated, as CUDA does.
cudaError_t check_unsafe_call(const char* what) {
    std::lock_guard<std::mutex> lock(capture_mutex);
    const Capture* forbidding = nullptr;
    for (const auto& c : active_captures()) {
        if (c->mode == cudaStreamCaptureModeGlobal ||
            (c->mode == cudaStreamCaptureModeThreadLocal && c->thread == std::this_thread::get_id())) {
            invalidate(*c, std::string(what) + " (a call that may synchronise) during the capture");
            forbidding = c.get();
        }
    }
    if (!forbidding) return cudaSuccess;
    return report(cudaErrorStreamCaptureUnsupported,
                  std::string(what) + " is not allowed while a stream is being captured in " +
                      mode_name(forbidding->mode) + " mode (it may synchronise; the capture is invalidated)");
}

// cudaErrorStreamCaptureUnsupported when `stream`, which `what` waits for or
// queries, is being captured: its work is only recorded, so waiting for it
// (a host read of a result inside a captured region) cannot work.
cudaError_t check_not_captured(cudaStream_t stream, const char* what) {
    std::lock_guard<std::mutex> lock(capture_mutex);
    if (!stream->capture) return cudaSuccess;
    invalidate(*stream->capture, std::string(what) + " of a captured stream");
    return report(cudaErrorStreamCaptureUnsupported,
                  std::string(what) + " of a stream that is being captured: its work is recorded, not run, so it "
                                      "cannot be waited for or read back inside the capture (the capture is invalidated)");
}

// cudaErrorCapturedEvent when the latest record of `event` was in a
// capture: it stands for recorded work, not work that runs.
cudaError_t check_event_not_captured(cudaEvent_t event, const char* what) {
    std::lock_guard<std::mutex> lock(capture_mutex);
    if (!event->capture) return cudaSuccess;
    if (event->capture->active) invalidate(*event->capture, std::string(what) + " of an event recorded in it");
    return report(cudaErrorCapturedEvent, std::string(what) + " of an event last recorded in a stream capture");
}

// Runs a launched graph's nodes on the calling stream worker, one at a time
// in a random order that honours every recorded dependency.
void run_graph(const std::vector<GraphNode>& nodes, std::uint64_t launch) {
    const std::size_t n = nodes.size();
    std::vector<std::size_t> waiting(n);
    std::vector<std::vector<std::size_t>> users(n);
    std::vector<std::size_t> ready;
    for (std::size_t i = 0; i < n; ++i) {
        waiting[i] = nodes[i].deps.size();
        for (std::size_t d : nodes[i].deps) users[d].push_back(i);
        if (waiting[i] == 0) ready.push_back(i);
    }
    std::uint64_t state = mix(the_seed() ^ mix(launch + 0x6a09e667f3bcc909ull));
    while (!ready.empty()) {
        state = mix(state);
        const std::size_t at = state % ready.size();
        const std::size_t i = ready[at];
        ready[at] = ready.back();
        ready.pop_back();
        try {
            nodes[i].work();
        } catch (const std::exception& e) {
            throw Error(std::string(nodes[i].what) + " (graph node " + std::to_string(i) + "): " + e.what());
        }
        for (std::size_t u : users[i])
            if (--waiting[u] == 0) ready.push_back(u);
    }
}

// NANOQ_EMU_PROFILE=1: time spent per launch site, printed at exit.
class Profile {
public:
    static Profile* get() {
        static Profile* profile = std::getenv("NANOQ_EMU_PROFILE") ? new Profile() : nullptr;
        return profile;
    }
    void add(const GridArg& site, double seconds, std::uint64_t threads) {
        std::lock_guard<std::mutex> lock(mutex_);
        Entry& e = entries_[std::string(site.file) + ":" + std::to_string(site.line)];
        e.seconds += seconds;
        e.launches += 1;
        e.threads += threads;
    }
    ~Profile() = default;
    static void report() {
        Profile* p = get();
        std::vector<std::pair<std::string, Entry>> rows(p->entries_.begin(), p->entries_.end());
        std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.seconds > b.second.seconds; });
        std::fprintf(stderr, "nanoq emulator profile (seconds, launches, CUDA threads, site):\n");
        for (auto& r : rows)
            std::fprintf(stderr, "%9.3f %8llu %12llu %s\n", r.second.seconds,
                         static_cast<unsigned long long>(r.second.launches),
                         static_cast<unsigned long long>(r.second.threads), r.first.c_str());
    }

private:
    Profile() { std::atexit(&Profile::report); }
    struct Entry {
        double seconds = 0;
        std::uint64_t launches = 0, threads = 0;
    };
    std::mutex mutex_;
    std::map<std::string, Entry> entries_;
};

void run_grid(const Launch& launch) {
    count_kernel(tl_device, launch);  // the stream's worker runs with its device set
    const auto began = std::chrono::steady_clock::now();
    thread_local StackPool stacks;
    thread_local std::unique_ptr<BlockRun> run(new BlockRun());
    const dim3 g = launch.grid.grid;
    const std::uint64_t blocks = static_cast<std::uint64_t>(g.x) * g.y * g.z;
    // Blocks run one after another in an order shuffled from the seed.
    std::vector<std::uint64_t> order(blocks);
    for (std::uint64_t i = 0; i < blocks; ++i) order[i] = i;
    std::uint64_t state = mix(the_seed() ^ mix(~launch.sequence));
    for (std::uint64_t i = blocks; i > 1; --i) {
        state = mix(state);
        std::swap(order[i - 1], order[state % i]);
    }
    for (std::uint64_t linear : order) {
        const uint3 idx{static_cast<unsigned>(linear % g.x), static_cast<unsigned>((linear / g.x) % g.y),
                        static_cast<unsigned>(linear / (static_cast<std::uint64_t>(g.x) * g.y))};
        run->run(launch, idx, stacks);
    }
    tl_block = nullptr;
    if (Profile* profile = Profile::get())
        profile->add(launch.grid, std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(),
                     blocks * launch.block.x * launch.block.y * launch.block.z);
    const std::string broken = memory().check();
    if (!broken.empty())
        throw Error(broken + " (found after the kernel launched at " + launch.grid.file + ":" +
                    std::to_string(launch.grid.line) + ", emulator seed " + std::to_string(the_seed()) + ")");
}

}  // namespace

extern "C" void nanoq_emu_fiber_main(Fiber* fiber) { tl_run->fiber_main(fiber); }

// ---- device-side entry points -------------------------------------------------------
int barrier(int predicate, const char* what, const char* file, int line) {
    return tl_run->barrier(predicate, what, file, line);
}
const std::uint64_t* warp_exchange(WarpOp op, unsigned mask, std::uint64_t value, const char* what) {
    return tl_run->exchange(op, mask, value, what);
}
int lane_id() { return tl_run->lane(); }
void fail(const std::string& message) { throw Error(message); }
void shared_out_of_bounds(std::ptrdiff_t index, std::size_t count) {
    throw Error("shared memory access out of bounds: index " + std::to_string(index) + " of an array of " +
                std::to_string(count) + " elements");
}
void* static_shared(const void* tag, std::size_t bytes, std::size_t align, const char* name) {
    return tl_run->static_shared(tag, bytes, align, name);
}
void* dynamic_shared(std::size_t* bytes) { return tl_run->dynamic_shared(bytes); }
std::uint64_t seed() { return the_seed(); }
void set_seed(std::uint64_t seed, bool restore) {
    seed_override.store(seed);
    seed_overridden.store(!restore);
}

void launch_grid(const GridArg& grid, dim3 block, std::size_t dynamic_shared_bytes, cudaStream_t stream,
                 std::function<void()> body) {
    const dim3 g = grid.grid;
    const std::string site = std::string(grid.file) + ":" + std::to_string(grid.line);
    const std::uint64_t threads = static_cast<std::uint64_t>(block.x) * block.y * block.z;
    if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535u || g.z > 65535u) {
        launch_error(cudaErrorInvalidConfiguration, "invalid grid " + dims(g) + " for the kernel launched at " + site);
        return;
    }
    if (threads == 0 || threads > 1024 || block.z > 64) {
        launch_error(cudaErrorInvalidConfiguration,
                     "invalid block " + dims(block) + " for the kernel launched at " + site);
        return;
    }
    if (dynamic_shared_bytes > kStaticSharedLimit) {
        launch_error(cudaErrorInvalidValue, std::to_string(dynamic_shared_bytes) +
                                                " bytes of dynamic shared memory for the kernel launched at " + site);
        return;
    }
    const std::string no_image = missing_kernel_image();
    if (!no_image.empty()) {
        launch_error(cudaErrorNoKernelImageForDevice, no_image + ": the kernel launched at " + site);
        return;
    }
    cudaStream_t s = resolve(stream);
    auto launch = std::make_shared<Launch>(Launch{grid, block, dynamic_shared_bytes, std::move(body), 0});
    {
        std::lock_guard<std::mutex> lock(s->mutex);
        launch->sequence = s->launches++;
    }
    s->push([launch] { run_grid(*launch); }, "kernel");
}

void enqueue(cudaStream_t stream, std::function<void()> work, const char* what) {
    resolve(stream)->push(std::move(work), what);
}

}  // namespace nanoq_emu

// ---- the runtime API --------------------------------------------------------------------
using nanoq_emu::memory;
using nanoq_emu::report;

cudaError_t cudaGetDeviceCount(int* count) {
    *count = nanoq_emu::device_count();
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
    if (device < 0 || device >= nanoq_emu::device_count())
        return report(cudaErrorInvalidDevice, "invalid device ordinal " + std::to_string(device));
    switch (attribute) {
        case cudaDevAttrComputeCapabilityMajor: *value = nanoq_emu::compute_capability() / 10; return cudaSuccess;
        case cudaDevAttrComputeCapabilityMinor: *value = nanoq_emu::compute_capability() % 10; return cudaSuccess;
    }
    return report(cudaErrorInvalidValue, "cudaDeviceGetAttribute of an attribute the emulator does not know");
}

cudaError_t nanoq_emu::func_attributes(cudaFuncAttributes* attributes) {
    *attributes = cudaFuncAttributes{};
    const std::string no_image = missing_kernel_image();
    return no_image.empty() ? cudaSuccess : report(cudaErrorNoKernelImageForDevice, no_image);
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= nanoq_emu::device_count())
        return report(cudaErrorInvalidDevice, "invalid device ordinal " + std::to_string(device));
    nanoq_emu::tl_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    *device = nanoq_emu::tl_device;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
    {
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        bool capturing = false;
        for (const auto& c : nanoq_emu::active_captures())
            if (c->device == nanoq_emu::tl_device) {
                nanoq_emu::invalidate(*c, "cudaDeviceSynchronize during the capture");
                capturing = true;
            }
        if (capturing)
            return report(cudaErrorStreamCaptureUnsupported,
                          "cudaDeviceSynchronize while a stream of the device is being captured (the capture is "
                          "invalidated)");
    }
    const cudaError_t code = nanoq_emu::synchronize_device(nanoq_emu::tl_device);
    memory().trim(nanoq_emu::tl_device, 0);  // the pools' release threshold of 0
    return code;
}

cudaError_t cudaGetLastError() {
    const cudaError_t e = nanoq_emu::tl_last_error;
    nanoq_emu::tl_last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError() { return nanoq_emu::tl_last_error; }

const char* cudaGetErrorName(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
        case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
        case cudaErrorNotReady: return "cudaErrorNotReady";
        case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
        case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
        case cudaErrorIllegalState: return "cudaErrorIllegalState";
        case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
        case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
        case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
        case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
        case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
        case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
        case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    }
    return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
    // The emulator's own description of the last error this thread was given.
    if (error != cudaSuccess && error == nanoq_emu::tl_message_code && !nanoq_emu::tl_message.empty()) {
        static thread_local std::string text;
        text = std::string(cudaGetErrorName(error)) + " (CUDA emulator): " + nanoq_emu::tl_message;
        return text.c_str();
    }
    switch (error) {
        case cudaSuccess: return "no error";
        case cudaErrorMemoryAllocation: return "out of memory";
        default: return cudaGetErrorName(error);
    }
}

cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
    *pointer = nullptr;
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaMalloc")) return forbidden;
    if (const cudaError_t lost = nanoq_emu::check_device(nanoq_emu::tl_device)) return lost;
    *pointer = memory().allocate(bytes, nanoq_emu::tl_device);
    if (!*pointer)
        return report(cudaErrorMemoryAllocation,
                      "out of memory: " + std::to_string(bytes) + " bytes on emulated device " +
                          std::to_string(nanoq_emu::tl_device) + " (NANOQ_EMU_DEVICE_MEMORY " +
                          std::to_string(nanoq_emu::device_memory()) + ")");
    return cudaSuccess;
}

cudaError_t cudaFree(void* pointer) {
    if (!pointer) return cudaSuccess;
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaFree")) return forbidden;
    // As on a GPU, freeing waits for the device's queued work.
    const cudaError_t pending = nanoq_emu::synchronize_device(nanoq_emu::tl_device);
    try {
        memory().release(pointer, false);
    } catch (const std::exception& e) {
        return report(cudaErrorIllegalAddress, e.what());
    }
    return pending;
}

cudaError_t cudaMallocAsync(void** pointer, std::size_t bytes, cudaStream_t) {
    // From the device's pool where it holds a block of this size (freed in
    // stream order by then: the pool is the stream's own history here),
    // else new; host memory, usable at once, so by the stream's later work too.
    *pointer = memory().take_pooled(bytes, nanoq_emu::tl_device);
    return *pointer ? cudaSuccess : cudaMalloc(pointer, bytes);
}

cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream) {
    if (!pointer) return cudaSuccess;
    // Stream-ordered: back to the device's pool once the stream's earlier
    // work has run, without waiting for the device; the pool keeps it (see
    // Memory::pool).
    nanoq_emu::resolve(stream)->push([pointer] { memory().pool(pointer); }, "cudaFreeAsync", true);
    return cudaSuccess;
}

cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* pool, int device) {
    int count = 0;
    cudaGetDeviceCount(&count);
    if (device < 0 || device >= count) return report(cudaErrorInvalidDevice, "cudaDeviceGetMemPool: no such device");
    *pool = reinterpret_cast<cudaMemPool_t>(static_cast<std::uintptr_t>(device) + 1);
    return cudaSuccess;
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, std::size_t keep_bytes) {
    if (!pool) return report(cudaErrorInvalidValue, "cudaMemPoolTrimTo: no pool");
    memory().trim(static_cast<int>(reinterpret_cast<std::uintptr_t>(pool) - 1), keep_bytes);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void** pointer, std::size_t bytes) {
    *pointer = nullptr;
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaMallocHost")) return forbidden;
    *pointer = memory().allocate(bytes, -1);
    return *pointer ? cudaSuccess : report(cudaErrorMemoryAllocation, "out of pinned host memory");
}

cudaError_t cudaHostAlloc(void** pointer, std::size_t bytes, unsigned int) { return cudaMallocHost(pointer, bytes); }

cudaError_t cudaFreeHost(void* pointer) {
    if (!pointer) return cudaSuccess;
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaFreeHost")) return forbidden;
    const cudaError_t pending = nanoq_emu::synchronize_device(-1);
    try {
        memory().release(pointer, true);
    } catch (const std::exception& e) {
        return report(cudaErrorInvalidValue, e.what());
    }
    return pending;
}

cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
    *total_bytes = nanoq_emu::device_memory();
    *free_bytes = *total_bytes - memory().used(nanoq_emu::tl_device);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
    if (bytes == 0) return cudaSuccess;
    cudaStream_t s = nanoq_emu::resolve(stream);
    const bool src_pageable = !memory().registered(src);
    const bool dst_pageable = !memory().registered(dst);
    if (src_pageable || dst_pageable) {
        // A graph cannot hold a copy of pageable memory (the runtime stages it at the call).
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        if (s->capture) {
            nanoq_emu::invalidate(*s->capture, "cudaMemcpyAsync of pageable host memory");
            return report(cudaErrorStreamCaptureUnsupported,
                          "cudaMemcpyAsync to or from pageable host memory on a stream that is being captured "
                          "(use pinned memory, or copy outside the captured region; the capture is invalidated)");
        }
    }
    if (src_pageable && dst_pageable) {
        std::memcpy(dst, src, bytes);
        return cudaSuccess;
    }
    if (src_pageable) {
        // From pageable memory the call returns once the source is staged:
        // the caller may reuse it at once, as with the real runtime.
        ++nanoq_emu::pageable_copies;
        auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                          static_cast<const char*>(src) + bytes);
        s->push([dst, staged] { std::memcpy(dst, staged->data(), staged->size()); }, "cudaMemcpyAsync");
        return cudaSuccess;
    }
    s->push([dst, src, bytes] { std::memcpy(dst, src, bytes); }, "cudaMemcpyAsync");
    if (dst_pageable) {
        // Into pageable memory the copy is synchronous.
        std::string message;
        const cudaError_t code = s->synchronize(&message);
        if (code != cudaSuccess) return report(code, message);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaMemcpy")) return forbidden;
    const cudaError_t pending = nanoq_emu::synchronize_device(nanoq_emu::tl_device);
    if (pending != cudaSuccess) return pending;
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
    if (e != cudaSuccess) return e;
    std::string message;
    const cudaError_t code = nanoq_emu::resolve(nullptr)->synchronize(&message);
    return code == cudaSuccess ? cudaSuccess : report(code, message);
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int, const void* src, int, std::size_t bytes, cudaStream_t stream) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream) {
    nanoq_emu::resolve(stream)->push([dst, value, bytes] { std::memset(dst, value, bytes); }, "cudaMemsetAsync");
    return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, std::size_t bytes) {
    if (const cudaError_t forbidden = nanoq_emu::check_unsafe_call("cudaMemset")) return forbidden;
    cudaMemsetAsync(dst, value, bytes, nullptr);
    std::string message;
    const cudaError_t code = nanoq_emu::resolve(nullptr)->synchronize(&message);
    return code == cudaSuccess ? cudaSuccess : report(code, message);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
    if (const cudaError_t lost = nanoq_emu::check_device(nanoq_emu::tl_device)) return lost;
    *stream = new nanoq_emu_stream(nanoq_emu::tl_device);
    std::lock_guard<std::mutex> lock(nanoq_emu::streams_mutex);
    nanoq_emu::live_streams().push_back(*stream);
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream) return report(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of the default stream");
    {
        std::lock_guard<std::mutex> lock(nanoq_emu::streams_mutex);
        auto& streams = nanoq_emu::live_streams();
        auto it = std::find(streams.begin(), streams.end(), stream);
        if (it == streams.end()) return report(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of an unknown stream");
        std::lock_guard<std::mutex> capture_lock(nanoq_emu::capture_mutex);
        if (stream->capture) return report(cudaErrorIllegalState, "cudaStreamDestroy of a stream that is being captured");
        streams.erase(it);
    }
    std::string message;
    stream->synchronize(&message);  // queued work completes first, as on a GPU
    {
        std::unique_lock<std::mutex> lock(nanoq_emu::streams_mutex);
        nanoq_emu::streams_unpinned.wait(lock, [stream] { return stream->pins == 0; });
    }
    delete stream;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    if (const cudaError_t captured = nanoq_emu::check_not_captured(nanoq_emu::resolve(stream), "cudaStreamSynchronize"))
        return captured;
    std::string message;
    const cudaError_t code = nanoq_emu::resolve(stream)->synchronize(&message);
    memory().trim(nanoq_emu::tl_device, 0);  // the pools' release threshold of 0
    return code == cudaSuccess ? cudaSuccess : report(code, message);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    nanoq_emu::jitter();
    if (const cudaError_t captured = nanoq_emu::check_not_captured(nanoq_emu::resolve(stream), "cudaStreamQuery"))
        return captured;
    std::string message;
    const cudaError_t code = nanoq_emu::resolve(stream)->query(&message);
    if (code == cudaErrorNotReady) nanoq_emu::wait_if_stalled();
    return code == cudaSuccess || code == cudaErrorNotReady ? code : report(code, message);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    *event = new nanoq_emu_event();
    (*event)->timing = !(flags & cudaEventDisableTiming);
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    delete event;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    nanoq_emu::jitter();
    {
        // In a capture the event stands for the stream's frontier there.
        cudaStream_t s = nanoq_emu::resolve(stream);
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        if (s->capture) {
            event->capture = s->capture;
            event->capture_nodes = s->frontier;
            return cudaSuccess;
        }
        event->capture.reset();
        event->capture_nodes.clear();
    }
    std::uint64_t target;
    {
        std::lock_guard<std::mutex> lock(event->mutex);
        target = ++event->recorded;
    }
    nanoq_emu::resolve(stream)->push(
        [event, target] {
            std::lock_guard<std::mutex> lock(event->mutex);
            if (target > event->completed) event->completed_at = std::chrono::steady_clock::now();
            event->completed = std::max(event->completed, target);
            event->done.notify_all();
        },
        "cudaEventRecord", true);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
    {
        cudaStream_t s = nanoq_emu::resolve(stream);
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        const std::shared_ptr<nanoq_emu::Capture>& c = event->capture;
        if (c) {
            if (!c->active)
                return report(cudaErrorCapturedEvent,
                              "cudaStreamWaitEvent on an event last recorded in a capture that has ended");
            if (s->capture && s->capture != c) {
                nanoq_emu::invalidate(*c, "a wait that merges two captures");
                nanoq_emu::invalidate(*s->capture, "a wait that merges two captures");
                return report(cudaErrorStreamCaptureMerge,
                              "cudaStreamWaitEvent would merge two separate captures (the event is from another)");
            }
            if (!s->capture) {  // the stream joins the capture: a fork
                s->capture = c;
                s->frontier = event->capture_nodes;
                c->members.push_back(s);
                return cudaSuccess;
            }
            for (std::size_t node : event->capture_nodes)
                if (std::find(s->frontier.begin(), s->frontier.end(), node) == s->frontier.end())
                    s->frontier.push_back(node);
            return cudaSuccess;
        }
        if (s->capture) {
            std::lock_guard<std::mutex> event_lock(event->mutex);
            if (event->recorded > 0) {
                nanoq_emu::invalidate(*s->capture, "a wait on an event recorded outside the capture");
                return report(cudaErrorStreamCaptureIsolation,
                              "cudaStreamWaitEvent in a capture on an event recorded outside it (the graph would "
                              "depend on work outside it; the capture is invalidated)");
            }
            return cudaSuccess;  // a never-recorded event: nothing to wait for
        }
    }
    std::uint64_t target;
    {
        std::lock_guard<std::mutex> lock(event->mutex);
        target = event->recorded;  // the most recent record; none: nothing to wait for
    }
    if (target == 0) return cudaSuccess;
    nanoq_emu::resolve(stream)->push(
        [event, target] {
            std::unique_lock<std::mutex> lock(event->mutex);
            if (!event->done.wait_for(lock, std::chrono::seconds(120), [&] { return event->completed >= target; }))
                throw nanoq_emu::Error("cudaStreamWaitEvent: the event never completed in 120 s (a cycle of waits?)");
        },
        "cudaStreamWaitEvent", true);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (const cudaError_t captured = nanoq_emu::check_event_not_captured(event, "cudaEventSynchronize")) return captured;
    {
        std::unique_lock<std::mutex> lock(event->mutex);
        event->done.wait(lock, [&] { return event->completed >= event->recorded; });
    }
    memory().trim(nanoq_emu::tl_device, 0);  // the pools' release threshold of 0
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    nanoq_emu::jitter();
    if (const cudaError_t captured = nanoq_emu::check_event_not_captured(event, "cudaEventQuery")) return captured;
    {
        std::lock_guard<std::mutex> lock(event->mutex);
        if (event->completed >= event->recorded) return cudaSuccess;
    }
    nanoq_emu::wait_if_stalled();
    return cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float* milliseconds, cudaEvent_t start, cudaEvent_t end) {
    std::chrono::steady_clock::time_point from, to;
    for (auto [event, when] : {std::pair{start, &from}, std::pair{end, &to}}) {
        std::lock_guard<std::mutex> lock(event->mutex);
        if (!event->timing) return report(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime of an event without timing");
        if (event->recorded == 0 || event->completed < event->recorded) return cudaErrorNotReady;
        *when = event->completed_at;
    }
    *milliseconds = std::chrono::duration<float, std::milli>(to - from).count();
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    if (stream == nullptr || stream == cudaStreamLegacy)
        return report(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture of the legacy default stream");
    cudaStream_t s = nanoq_emu::resolve(stream);
    std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
    if (s->capture) return report(cudaErrorIllegalState, "cudaStreamBeginCapture of a stream already being captured");
    auto c = std::make_shared<nanoq_emu::Capture>();
    c->device = s->device;
    c->mode = mode;
    c->thread = std::this_thread::get_id();
    c->origin = s;
    c->members.push_back(s);
    s->capture = c;
    s->frontier.clear();
    nanoq_emu::active_captures().push_back(c);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
    if (!graph) return report(cudaErrorInvalidValue, "cudaStreamEndCapture without a graph to return");
    *graph = nullptr;
    cudaStream_t s = nanoq_emu::resolve(stream);
    std::shared_ptr<nanoq_emu::Capture> c;
    std::string unjoined;
    // A capture that ends in an error makes no graph: its work is dropped
    // here (outside the lock), as CUDA drops the graph it was building and
    // what that held (NCCL's hold on the communicators of its collectives).
    // Events recorded in it still name the ended capture.
    std::vector<nanoq_emu::GraphNode> dropped;
    {
        std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
        c = s->capture;
        if (!c) return report(cudaErrorIllegalState, "cudaStreamEndCapture of a stream that is not being captured");
        if (c->origin != s) {
            nanoq_emu::invalidate(*c, "cudaStreamEndCapture on a stream that joined it");
            return report(cudaErrorStreamCaptureUnmatched,
                          "cudaStreamEndCapture on a stream that joined the capture, not the one that began it");
        }
        if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
            nanoq_emu::invalidate(*c, "cudaStreamEndCapture from another thread");
            return report(cudaErrorStreamCaptureWrongThread,
                          "cudaStreamEndCapture from another thread than the one that began the capture");
        }
        // Joined: the last work of every other stream in the capture is an
        // ancestor of the origin's (its frontier's).
        std::vector<char> reached(c->nodes.size(), 0);
        std::vector<std::size_t> todo = s->frontier;
        while (!todo.empty()) {
            const std::size_t node = todo.back();
            todo.pop_back();
            if (reached[node]) continue;
            reached[node] = 1;
            for (std::size_t d : c->nodes[node].deps) todo.push_back(d);
        }
        for (cudaStream_t member : c->members)
            for (std::size_t node : member->frontier)
                if (!reached[node] && unjoined.empty()) unjoined = c->nodes[node].what;
        for (cudaStream_t member : c->members) {
            member->capture.reset();
            member->frontier.clear();
        }
        c->active = false;
        auto& active = nanoq_emu::active_captures();
        active.erase(std::find(active.begin(), active.end(), c));
        if (c->invalidated || !unjoined.empty()) dropped = std::move(c->nodes);
    }
    if (c->invalidated)
        return report(cudaErrorStreamCaptureInvalidated, "the capture was invalidated by " + c->why);
    if (!unjoined.empty())
        return report(cudaErrorStreamCaptureUnjoined,
                      "the capture ends with work on another stream (" + unjoined +
                          ") that the capturing stream never waited for: join every forked stream back with an event");
    *graph = new nanoq_emu_graph{std::move(c->nodes), c->device};
    ++nanoq_emu::graphs_captured;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
    cudaStream_t s = nanoq_emu::resolve(stream);
    std::lock_guard<std::mutex> lock(nanoq_emu::capture_mutex);
    *status = !s->capture ? cudaStreamCaptureStatusNone
              : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                        : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
    if (!exec || !graph) return report(cudaErrorInvalidValue, "cudaGraphInstantiate of a null graph");
    *exec = new nanoq_emu_graph_exec();
    (*exec)->nodes = std::make_shared<const std::vector<nanoq_emu::GraphNode>>(graph->nodes);
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    if (!exec) return report(cudaErrorInvalidResourceHandle, "cudaGraphLaunch of a null executable graph");
    std::shared_ptr<const std::vector<nanoq_emu::GraphNode>> nodes = exec->nodes;
    const std::uint64_t launch = exec->launches++;
    ++nanoq_emu::graphs_launched;
    nanoq_emu::resolve(stream)->push([nodes, launch] { nanoq_emu::run_graph(*nodes, launch); }, "cudaGraphLaunch");
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;  // launches in flight hold the nodes
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

// ---- emulator control for tests (exported: tests reach them with ctypes) ---------------
// Graphs made by cudaStreamEndCapture and launches of graphs, so far.
extern "C" __attribute__((visibility("default"))) void nanoq_emu_graph_counts(unsigned long long* captured,
                                                                              unsigned long long* launched) {
    *captured = nanoq_emu::graphs_captured.load();
    *launched = nanoq_emu::graphs_launched.load();
}

// Device `device` is lost now (after_kernels <= 0) or when the after_kernels-th
// kernel from now runs on it; see DeviceFault above. There is no way back.
extern "C" __attribute__((visibility("default"))) void nanoq_emu_lose_device(int device, long after_kernels) {
    nanoq_emu::DeviceFault* f = nanoq_emu::device_fault(device);
    if (!f) return;
    if (after_kernels <= 0)
        f->lost = true;
    else
        f->kernels_left = after_kernels;
}

// How many host-to-device copies so far read pageable host memory (those
// from pinned memory are truly asynchronous on a GPU; these are not).
extern "C" __attribute__((visibility("default"))) unsigned long long nanoq_emu_pageable_copies() {
    return nanoq_emu::pageable_copies.load();
}
