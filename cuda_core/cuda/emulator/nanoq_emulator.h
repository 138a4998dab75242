// A CPU runtime for nanoq's CUDA kernels: the CUDA execution model as the
// kernels use it, so that the same .cu sources compile with the host C++
// compiler and run (slowly, and checked) on any machine.
//
// Written for nanoq's tests; no emulator we know of fits: they either
// translate PTX (needs the GPU toolchain's output and is heavy) or run
// threads one after another (so __syncthreads in the middle of a kernel and
// warp shuffles cannot work). Here every CUDA thread is a fiber with its own
// stack; a block's fibers run on one OS thread in an order shuffled from a
// seed, switching only at barriers and warp intrinsics. What real hardware
// leaves undefined, this runtime reports as an error of the launch (a sticky
// error of the stream, as a failed kernel is on a GPU):
//   - a __syncthreads() that not every thread of the block reaches, threads
//     at different __syncthreads() call sites, a thread that exits while
//     others wait at a barrier;
//   - warp intrinsics whose mask leaves out the caller, names exited or
//     missing lanes, reads a lane outside the mask, or disagrees between lanes;
//   - shared-memory accesses outside their array (NANOQ_SHARED arrays and
//     dynamic shared memory are checked on every access); shared memory
//     starts filled with 0xff bytes (NaN as floats), as stale data would;
//   - writes past the end of cudaMalloc'ed buffers (canaries, checked at
//     every synchronisation and free). In an AddressSanitizer build
//     (tests/sanitize/run.sh address) the canaries are poisoned instead, so
//     that any read or write of them is reported at the access, in the
//     kernel's code, and every fiber switch is announced to ASan.
// Blocks of a grid run one after another in a shuffled order; streams are
// in-order queues, each drained by a worker thread, so host and device run
// asynchronously as on a GPU. The seed comes from NANOQ_EMU_SEED (printed
// in every error message); the same seed replays the same schedule.
//
// This header is included by the emulator's cuda_runtime.h; kernels never
// include it directly.
#pragma once

#include <atomic>
#include <cmath>
#include <memory>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define NANOQ_CUDA_EMULATED 1

// ---- CUDA keywords ---------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

typedef struct nanoq_emu_stream* cudaStream_t;
typedef struct nanoq_emu_event* cudaEvent_t;

namespace nanoq_emu {

// An error found while running a kernel (or inside a stream's work).
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// ---- what a running CUDA thread sees ------------------------------------
struct ThreadState {
    uint3 thread_idx;
    int linear;  // x + y * bx + z * bx * by
};
struct BlockView {
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
extern thread_local const ThreadState* tl_thread;
extern thread_local const BlockView* tl_block;

// ---- barriers and warp intrinsics (emulator.cpp) --------------------------
// Block barrier; `predicate` is combined over the block: returns the count
// of threads whose predicate was non-zero.
int barrier(int predicate, const char* what, const char* file, int line);

enum class WarpOp : int { Shuffle = 0, Vote = 1, Sync = 2 };
// Every lane of `mask` contributes `value`; returns the 32 lanes' values
// (valid for lanes in the mask) to the caller, who picks what it needs.
// `valid` receives the mask of lanes that contributed.
const std::uint64_t* warp_exchange(WarpOp op, unsigned mask, std::uint64_t value, const char* what);
int lane_id();
[[noreturn]] void fail(const std::string& message);

// ---- shared memory -----------------------------------------------------------
[[noreturn]] void shared_out_of_bounds(std::ptrdiff_t index, std::size_t count);

// A pointer into shared memory that knows the bounds of its array.
template <class T> class SharedPtr {
public:
    SharedPtr() = default;
    SharedPtr(T* base, std::size_t count, std::ptrdiff_t offset = 0) : base_(base), count_(count), offset_(offset) {}
    template <class U, class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_same<U, T>::value>>
    SharedPtr(const SharedPtr<U>& other) : base_(other.base()), count_(other.count()), offset_(other.offset()) {}

    T& operator[](std::ptrdiff_t i) const { return *checked(offset_ + i); }
    T& operator*() const { return *checked(offset_); }
    T* operator->() const { return checked(offset_); }
    SharedPtr operator+(std::ptrdiff_t i) const { return SharedPtr(base_, count_, offset_ + i); }
    SharedPtr operator-(std::ptrdiff_t i) const { return SharedPtr(base_, count_, offset_ - i); }
    SharedPtr& operator+=(std::ptrdiff_t i) { offset_ += i; return *this; }
    SharedPtr& operator-=(std::ptrdiff_t i) { offset_ -= i; return *this; }
    SharedPtr& operator++() { ++offset_; return *this; }
    std::ptrdiff_t operator-(const SharedPtr& other) const { return offset_ - other.offset_; }
    bool operator==(const SharedPtr& other) const { return base_ + offset_ == other.base_ + other.offset_; }
    bool operator!=(const SharedPtr& other) const { return !(*this == other); }

    T* base() const { return base_; }
    std::size_t count() const { return count_; }
    std::ptrdiff_t offset() const { return offset_; }

private:
    T* checked(std::ptrdiff_t i) const {
        if (i < 0 || static_cast<std::size_t>(i) >= count_) shared_out_of_bounds(i, count_);
        return base_ + i;
    }
    T* base_ = nullptr;
    std::size_t count_ = 0;
    std::ptrdiff_t offset_ = 0;
};

template <class E, std::size_t N> struct CheckedArray {
    E data_[N];
    E& operator[](std::ptrdiff_t i) {
        if (i < 0 || static_cast<std::size_t>(i) >= N) shared_out_of_bounds(i, N);
        return data_[i];
    }
    const E& operator[](std::ptrdiff_t i) const { return const_cast<CheckedArray&>(*this)[i]; }
    operator SharedPtr<E>() { return SharedPtr<E>(data_, N); }
    operator SharedPtr<const E>() const { return SharedPtr<const E>(data_, N); }
    SharedPtr<E> operator+(std::ptrdiff_t i) { return SharedPtr<E>(data_, N, i); }
};

// The checked type of a __shared__ declaration's type: arrays become
// CheckedArrays (of checked rows), scalars stay themselves.
template <class T> struct Checked { using type = T; };
template <class T, std::size_t N> struct Checked<T[N]> { using type = CheckedArray<typename Checked<T>::type, N>; };
template <class T> using checked_t = typename Checked<T>::type;

// The block's instance of the shared variable identified by `tag` (the
// address of a static local at the declaration), made on first use in the
// block and filled with 0xff bytes.
void* static_shared(const void* tag, std::size_t bytes, std::size_t align, const char* name);
// The launch's dynamic shared memory (its size in bytes).
void* dynamic_shared(std::size_t* bytes);

template <class T> inline checked_t<T>& shared_variable(const void* tag, const char* name) {
    static_assert(std::is_trivially_default_constructible<checked_t<T>>::value, "shared memory holds plain data");
    return *static_cast<checked_t<T>*>(static_shared(tag, sizeof(checked_t<T>), alignof(checked_t<T>), name));
}
template <class T> inline SharedPtr<T> dynamic_shared_array() {
    std::size_t bytes = 0;
    T* data = static_cast<T*>(dynamic_shared(&bytes));
    return SharedPtr<T>(data, bytes / sizeof(T));
}

// ---- launches -----------------------------------------------------------------
// The grid argument of a launch; it records the call site of the launch.
struct GridArg {
    dim3 grid;
    const char* file;
    int line;
    GridArg(dim3 g, const char* f = __builtin_FILE(), int l = __builtin_LINE()) : grid(g), file(f), line(l) {}
    GridArg(int g, const char* f = __builtin_FILE(), int l = __builtin_LINE())
        : grid(static_cast<unsigned>(g)), file(f), line(l) {}
    GridArg(unsigned g, const char* f = __builtin_FILE(), int l = __builtin_LINE()) : grid(g), file(f), line(l) {}
};

// Validates the configuration (a bad one is the caller's cudaGetLastError())
// and queues the grid on the stream; `body` runs once per CUDA thread.
void launch_grid(const GridArg& grid, dim3 block, std::size_t dynamic_shared_bytes, cudaStream_t stream,
                 std::function<void()> body);

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), const GridArg& grid, dim3 block, std::size_t dynamic_shared_bytes,
            cudaStream_t stream, Args&&... args) {
    // Arguments are copied at launch, as a GPU copies them to constant memory.
    auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    launch_grid(grid, block, dynamic_shared_bytes, stream, [kernel, params] { std::apply(kernel, *params); });
}

// ---- emulator control (for tests) ---------------------------------------------
std::uint64_t seed();
// Replaces the seed (tests of the emulator); restore = true goes back to NANOQ_EMU_SEED.
void set_seed(std::uint64_t seed, bool restore = false);

}  // namespace nanoq_emu

// ---- built-in variables ------------------------------------------------------
#define threadIdx (::nanoq_emu::tl_thread->thread_idx)
#define blockIdx (::nanoq_emu::tl_block->block_idx)
#define blockDim (::nanoq_emu::tl_block->block_dim)
#define gridDim (::nanoq_emu::tl_block->grid_dim)
constexpr int warpSize = 32;

// ---- synchronisation -----------------------------------------------------------
#define __syncthreads() ((void)::nanoq_emu::barrier(0, "__syncthreads()", __FILE__, __LINE__))
#define __syncthreads_count(p) (::nanoq_emu::barrier((p) != 0, "__syncthreads_count()", __FILE__, __LINE__))
#define __syncthreads_or(p) (::nanoq_emu::barrier((p) != 0, "__syncthreads_or()", __FILE__, __LINE__) != 0)
#define __syncthreads_and(p) \
    (::nanoq_emu::barrier((p) != 0, "__syncthreads_and()", __FILE__, __LINE__) == ::nanoq_emu::block_threads())
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
#define __threadfence_block() std::atomic_thread_fence(std::memory_order_seq_cst)

namespace nanoq_emu {
inline int block_threads() {
    const dim3& b = tl_block->block_dim;
    return static_cast<int>(b.x * b.y * b.z);
}

template <class T> inline std::uint64_t to_bits(T value) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp intrinsics move up to 64 bits");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    return bits;
}
template <class T> inline T from_bits(std::uint64_t bits) {
    T value;
    std::memcpy(&value, &bits, sizeof(T));
    return value;
}

// The value of lane `src` (checked to be in the exchange's mask).
template <class T> inline T shuffle_read(const std::uint64_t* values, unsigned mask, int src, const char* what) {
    if (!(mask >> src & 1u))
        fail(std::string(what) + " by lane " + std::to_string(lane_id()) + " reads lane " + std::to_string(src) +
             ", which is not in the mask");
    return from_bits<T>(values[src]);
}

inline void check_width(int width, const char* what) {
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail(std::string(what) + ": width " + std::to_string(width) + " is not a power of two in [1, 32]");
}
}  // namespace nanoq_emu

template <class T> inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    ::nanoq_emu::check_width(width, "__shfl_sync");
    const std::uint64_t* v = ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Shuffle, mask,
                                                        ::nanoq_emu::to_bits(var), "__shfl_sync");
    const int lane = ::nanoq_emu::lane_id();
    const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    return ::nanoq_emu::shuffle_read<T>(v, mask, src, "__shfl_sync");
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    ::nanoq_emu::check_width(width, "__shfl_up_sync");
    const std::uint64_t* v = ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Shuffle, mask,
                                                        ::nanoq_emu::to_bits(var), "__shfl_up_sync");
    const int lane = ::nanoq_emu::lane_id();
    const int in_segment = lane & (width - 1);
    if (in_segment < static_cast<int>(delta)) return var;
    return ::nanoq_emu::shuffle_read<T>(v, mask, lane - static_cast<int>(delta), "__shfl_up_sync");
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    ::nanoq_emu::check_width(width, "__shfl_down_sync");
    const std::uint64_t* v = ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Shuffle, mask,
                                                        ::nanoq_emu::to_bits(var), "__shfl_down_sync");
    const int lane = ::nanoq_emu::lane_id();
    const int in_segment = lane & (width - 1);
    if (in_segment + static_cast<int>(delta) >= width) return var;
    return ::nanoq_emu::shuffle_read<T>(v, mask, lane + static_cast<int>(delta), "__shfl_down_sync");
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    ::nanoq_emu::check_width(width, "__shfl_xor_sync");
    const std::uint64_t* v = ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Shuffle, mask,
                                                        ::nanoq_emu::to_bits(var), "__shfl_xor_sync");
    const int lane = ::nanoq_emu::lane_id();
    const int src = lane ^ lane_mask;
    // A lane may read from its own or an earlier group of `width` lanes;
    // from a later group (or beyond the warp) it keeps its own value.
    if (src > 31 || src / width > lane / width) return var;
    return ::nanoq_emu::shuffle_read<T>(v, mask, src, "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    const std::uint64_t* v =
        ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Vote, mask, predicate != 0, "__ballot_sync");
    unsigned ballot = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1u) && v[lane]) ballot |= 1u << lane;
    return ballot;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ::nanoq_emu::warp_exchange(::nanoq_emu::WarpOp::Sync, mask, 0, "__syncwarp");
}

// ---- atomics (a block's fibers share one OS thread, but streams run
// concurrently, so these are real atomics) -------------------------------------
template <class T> inline T atomicAdd(T* address, T value) {
    if constexpr (std::is_integral<T>::value) {
        return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
    } else {
        T old;
        __atomic_load(address, &old, __ATOMIC_SEQ_CST);
        T desired = old + value;
        while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            desired = old + value;
        return old;
    }
}
template <class T> inline T atomicMin(T* address, T value) {
    T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
    while (value < old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
template <class T> inline T atomicMax(T* address, T value) {
    T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
    while (value > old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
template <class T> inline T atomicExch(T* address, T value) { return __atomic_exchange_n(address, value, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicCAS(T* address, T compare, T value) {
    __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}

// ---- math and bit casts --------------------------------------------------------
using std::isfinite;
using std::isinf;
using std::isnan;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float x) { return nanoq_emu::from_bits<unsigned>(nanoq_emu::to_bits(x)); }
inline int __float_as_int(float x) { return nanoq_emu::from_bits<int>(nanoq_emu::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return nanoq_emu::from_bits<float>(nanoq_emu::to_bits(x)); }
inline float __int_as_float(int x) { return nanoq_emu::from_bits<float>(nanoq_emu::to_bits(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// ---- the one launch form (see kernel_utils.cuh) ----------------------------------
#define NANOQ_SHARED(type, name)                                                                  \
    static const char nanoq_shared_tag_##name = 0;                                                \
    ::nanoq_emu::checked_t<type>& name = ::nanoq_emu::shared_variable<type>(&nanoq_shared_tag_##name, #name)
#define NANOQ_DYNAMIC_SHARED(type, name) ::nanoq_emu::SharedPtr<type> name = ::nanoq_emu::dynamic_shared_array<type>()
