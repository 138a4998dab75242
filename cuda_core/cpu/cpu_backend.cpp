// The CPU backend: every op in fp32, OpenMP loops, and OpenBLAS sgemm or the
// portable sgemm below (cpu_gemm() says which).
//
// This is the reference backend that every test runs on. Each device is a
// worker thread over host memory; `threads` OpenMP threads serve it, each
// calling a single-threaded sgemm on its own block of a matmul.
// Reductions that feed weights (weight/bias/norm gradients, sums of squares,
// loss statistics) run in a fixed order independent of the thread count, so
// results are bitwise reproducible for a given device count.
#include <omp.h>

#include <malloc.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "allocator.h"
#include "backend.h"
#include "dropout.h"
#include "nanoq/errors.h"
#include "nanoq/trainer.h"
#ifdef NANOQ_HAVE_OPENBLAS
#include "cblas.h"
#endif

namespace nanoq {

std::vector<ScratchBuffer> cpu_scratch_plan(const ScratchShapes& shapes, int threads, bool ask_libraries);

namespace {

// ---------------------------------------------------------------------------
// Host memory. Linux hands out memory it does not have (overcommit) and,
// once the pages are touched, the kernel's out-of-memory killer ends the
// process: no error, no saved work. So the cpu backend keeps its own count
// of what its trainers hold (all devices and trainers of the process) and
// refuses an allocation that would pass what the machine had available when
// that count last stood at zero: MemAvailable of /proc/meminfo, or less
// where the process's memory cgroups (v2 memory.max, v1
// memory.limit_in_bytes; its own and those above it) leave less.
// NANOQ_CPU_MEMORY_AVAILABLE (bytes) names the figure instead.
// ---------------------------------------------------------------------------

// A "Key:   123 kB" line's bytes from /proc/meminfo; 0 when absent.
std::size_t meminfo_bytes(const std::string& key) {
    std::ifstream in("/proc/meminfo");
    std::string name, unit;
    unsigned long long value = 0;
    while (in >> name >> value) {
        std::getline(in, unit);
        if (name == key + ":") return static_cast<std::size_t>(value) * 1024;
    }
    return 0;
}

// A cgroup file's number; 0 when absent or "max" (no limit).
std::size_t cgroup_number(const std::string& path) {
    std::ifstream in(path);
    unsigned long long value = 0;
    return in >> value ? static_cast<std::size_t>(value) : 0;
}

// A "key value" line's value in a cgroup's memory.stat; 0 when absent.
std::size_t cgroup_stat(const std::string& path, const std::string& key) {
    std::ifstream in(path);
    std::string name;
    unsigned long long value = 0;
    while (in >> name >> value)
        if (name == key) return static_cast<std::size_t>(value);
    return 0;
}

}  // namespace

std::size_t cgroup_memory_available(const std::string& self_cgroup, const std::string& cgroup_root) {
    std::size_t least = SIZE_MAX;
    std::ifstream self(self_cgroup);
    std::string line;
    while (std::getline(self, line)) {
        // v2: "0::/path"; v1: "N:memory:/path" (or with other controllers: "N:cpu,memory:/path").
        const std::size_t first = line.find(':'), second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) continue;
        const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
        const bool v2 = controllers == ",,";
        if (!v2 && controllers.find(",memory,") == std::string::npos) continue;
        std::string path = line.substr(second + 1);
        const std::string root = v2 ? cgroup_root : cgroup_root + "/memory";
        for (;;) {
            const std::string dir = root + (path == "/" ? "" : path);
            const std::size_t limit = cgroup_number(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
            if (limit && limit < (std::size_t(1) << 60)) {  // v1 writes a huge number for "no limit"
                std::size_t used = cgroup_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
                const std::size_t reclaimable =
                    cgroup_stat(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
                used -= std::min(used, reclaimable);
                least = std::min(least, limit > used ? limit - used : 0);
            }
            if (path.empty() || path == "/") break;
            const std::size_t slash = path.rfind('/');
            path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
        }
    }
    return least;
}

namespace {

// The host memory the cpu backend may hold, and where the figure comes from.
std::size_t host_memory_available(std::string* source) {
    if (const char* given = std::getenv("NANOQ_CPU_MEMORY_AVAILABLE"); given && *given) {
        const std::string text = given;
        const bool digits = text.find_first_not_of("0123456789") == std::string::npos;
        errno = 0;
        const unsigned long long value = digits ? std::strtoull(given, nullptr, 10) : 0;
        if (!digits || !value || errno == ERANGE)
            throw InvalidArgument("NANOQ_CPU_MEMORY_AVAILABLE must be a number of bytes above 0, not '" + text + "'");
        *source = "as NANOQ_CPU_MEMORY_AVAILABLE says";
        return static_cast<std::size_t>(value);
    }
    *source = "MemAvailable of /proc/meminfo, within the process's memory cgroups; NANOQ_CPU_MEMORY_AVAILABLE "
              "overrides";
    // Memory that freed trainers left in the C library's free lists would
    // not count as available: give it back first.
    malloc_trim(0);
    const std::size_t available =
        std::min(meminfo_bytes("MemAvailable"), cgroup_memory_available("/proc/self/cgroup", "/sys/fs/cgroup"));
    return available == SIZE_MAX ? 0 : available;  // 0: unknown (no /proc): no check
}

struct HostCount {
    std::mutex mutex;
    std::size_t held = 0;       // bytes the cpu backends of this process hold
    std::size_t available = 0;  // the machine's, read when `held` was last 0
    std::string source;         // where `available` comes from
};

HostCount& host_memory() {
    static HostCount* count = new HostCount;  // never destroyed: trainers may outlive static destruction
    return *count;
}

constexpr std::int64_t kReduceBlock = 1 << 14;  // elements per partial sum of sum_squares

// ---------------------------------------------------------------------------
// The portable sgemm: always compiled, so that it is tested where OpenBLAS is
// present too. Goto-style: op(B) is packed a [KC, NC] panel at a time into
// NR-wide column slivers, op(A) a [MC, KC] block at a time into MR-tall row
// slivers (zero-padded at the edges, which is where the transposes are
// handled), and a register-tiled MR x NR micro-kernel in GCC/Clang vector
// types multiplies one sliver pair. Single-threaded and reentrant (packing
// buffers per call): it runs inside the backend's OpenMP regions exactly as
// the single-threaded OpenBLAS call does. Every C element sums k in the same
// order wherever its tile lies, so results do not depend on the split.
// ---------------------------------------------------------------------------

typedef float Vec8 __attribute__((vector_size(32)));  // two per micro-tile row
constexpr int kMR = 6, kNR = 16;                          // 12 accumulators: fits 16 vector registers
constexpr int kKC = 256, kMC = 120, kNC = 2048;            // A block in L2, B panel in L3

struct FreeDeleter {
    void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float, FreeDeleter>;

Buffer aligned_floats(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return Buffer(static_cast<float*>(p));
}

// C[M,N] = beta * C (beta 0 writes zeros: C may hold NaN).
void scale_rows(float* c, int M, int N, int ldc, float beta) {
    for (int i = 0; i < M; ++i) {
        float* row = c + std::int64_t(i) * ldc;
        for (int j = 0; j < N; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
}

// Packs op(X)[rows r0.., cols k0..] (op(X)(r, k) = trans ? X[k, r] : X[r, k])
// as slivers of `width` rows: out[s][k][i] = op(X)(r0 + s*width + i, k0 + k).
// op(A) packs with width kMR; op(B)^T (so rows are B's columns) with kNR.
template <int width>
void pack(float* out, const float* x, int ld, bool trans, int r0, int rows, int k0, int depth) {
    for (int s = 0; s < rows; s += width) {
        const int live = std::min(width, rows - s);
        for (int k = 0; k < depth; ++k, out += width) {
            int i = 0;
            if (trans) {  // the sliver's rows are contiguous in x
                const float* src = x + std::int64_t(k0 + k) * ld + r0 + s;
                for (; i < live; ++i) out[i] = src[i];
            } else {
                const float* src = x + std::int64_t(r0 + s) * ld + k0 + k;
                for (; i < live; ++i) out[i] = src[std::int64_t(i) * ld];
            }
            for (; i < width; ++i) out[i] = 0.0f;
        }
    }
}

// acc[kMR][kNR] = sum over k of the packed A sliver's column k times the packed B sliver's row k.
__attribute__((always_inline)) inline void micro_kernel(int depth, const float* a, const float* b,
                                                         float* acc) {
    Vec8 c[kMR][2] = {};
    for (int k = 0; k < depth; ++k, a += kMR, b += kNR) {
        Vec8 b0, b1;
        std::memcpy(&b0, b, sizeof b0);
        std::memcpy(&b1, b + 8, sizeof b1);
        for (int i = 0; i < kMR; ++i) {
            c[i][0] += a[i] * b0;
            c[i][1] += a[i] * b1;
        }
    }
    std::memcpy(acc, c, sizeof c);
}

// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C, the cblas_sgemm
// contract (beta 0 never reads C). On x86-64 one clone per ISA level (AVX2 +
// FMA, and the baseline), picked at load time by the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void portable_sgemm(float* c, const float* a, const float* b, int M, int N, int K, int lda, int ldb, int ldc,
                    bool trans_a, bool trans_b, float alpha, float beta) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0 || alpha == 0.0f) {
        if (beta != 1.0f) scale_rows(c, M, N, ldc, beta);
        return;
    }
    const int kc_max = std::min(K, kKC), nc_max = std::min(N, kNC), mc_max = std::min(M, kMC);
    Buffer packed_b = aligned_floats(std::size_t(kc_max) * ((nc_max + kNR - 1) / kNR * kNR));
    Buffer packed_a = aligned_floats(std::size_t(kc_max) * ((mc_max + kMR - 1) / kMR * kMR));
    alignas(64) float acc[kMR * kNR];
    for (int jc = 0; jc < N; jc += kNC) {
        const int nc = std::min(kNC, N - jc);
        for (int pc = 0; pc < K; pc += kKC) {
            const int kc = std::min(kKC, K - pc);
            const float keep = pc == 0 ? beta : 1.0f;  // later K blocks add to the first's result
            pack<kNR>(packed_b.get(), b, ldb, !trans_b, jc, nc, pc, kc);
            for (int ic = 0; ic < M; ic += kMC) {
                const int mc = std::min(kMC, M - ic);
                pack<kMR>(packed_a.get(), a, lda, trans_a, ic, mc, pc, kc);
                for (int jr = 0; jr < nc; jr += kNR) {
                    const int nr = std::min(kNR, nc - jr);
                    for (int ir = 0; ir < mc; ir += kMR) {
                        const int mr = std::min(kMR, mc - ir);
                        micro_kernel(kc, packed_a.get() + std::int64_t(ir) * kc, packed_b.get() + std::int64_t(jr) * kc,
                                     acc);
                        float* tile = c + std::int64_t(ic + ir) * ldc + jc + jr;
                        for (int i = 0; i < mr; ++i) {
                            float* row = tile + std::int64_t(i) * ldc;
                            const float* sum = acc + i * kNR;
                            if (keep == 0.0f)
                                for (int j = 0; j < nr; ++j) row[j] = alpha * sum[j];
                            else
                                for (int j = 0; j < nr; ++j) row[j] = alpha * sum[j] + keep * row[j];
                        }
                    }
                }
            }
        }
    }
}

#ifdef NANOQ_HAVE_OPENBLAS
constexpr bool kOpenBlasBuilt = true;
#else
constexpr bool kOpenBlasBuilt = false;
#endif

}  // namespace

HostMemory cpu_host_memory() {
    HostCount& host = host_memory();
    std::lock_guard<std::mutex> lock(host.mutex);
    HostMemory memory;
    if (host.held) return HostMemory{host.available, host.source};
    memory.bytes = host_memory_available(&memory.source);
    return memory;
}

// The one place that decides which sgemm a cpu backend runs: OpenBLAS when
// this build links it, else the portable one; NANOQ_CPU_GEMM=portable (or
// =openblas) overrides, read by each backend when it is created.
CpuGemm cpu_gemm() {
    const char* env = std::getenv("NANOQ_CPU_GEMM");
    const std::string wanted = env ? env : "";
    if (wanted == "portable" || (wanted.empty() && !kOpenBlasBuilt)) return CpuGemm{"portable", kOpenBlasBuilt};
    if (wanted.empty() || (wanted == "openblas" && kOpenBlasBuilt)) return CpuGemm{"openblas", kOpenBlasBuilt};
    if (wanted == "openblas")
        throw InvalidArgument("NANOQ_CPU_GEMM=openblas, but this build of nanoq has no OpenBLAS "
                              "(scipy-openblas32 was not installed where it was built)");
    throw InvalidArgument("NANOQ_CPU_GEMM must be \"openblas\", \"portable\" or unset, got \"" + wanted + "\"");
}

namespace {

class CpuBackend final : public Backend {
public:
    explicit CpuBackend(int threads) : threads_(std::max(1, threads)), openblas_(cpu_gemm().name == "openblas") {
#ifdef NANOQ_HAVE_OPENBLAS
        // One thread pool only: OpenBLAS runs single-threaded inside our
        // OpenMP regions. Its own pool would spin against OpenMP's for the
        // same cores (measured: >60% of cycles lost to spinning).
        scipy_openblas_set_num_threads(1);
#endif
    }

    std::string name() const override { return "cpu"; }

    void* raw_alloc(std::size_t bytes, MemoryKind) override {
        refusal_.clear();
        HostCount& host = host_memory();
        std::lock_guard<std::mutex> lock(host.mutex);
        if (!host.held) host.available = host_memory_available(&host.source);
        const std::size_t size = StackArena::aligned(bytes);
        if (host.available && host.held + size > host.available) {
            refusal_ = "the process's cpu trainers would hold " + human_bytes(host.held + size) +
                       " of host memory, and the machine had " + human_bytes(host.available) + " available (" +
                       host.source + ")";
            return nullptr;
        }
        void* data = std::aligned_alloc(StackArena::kAlignment, size);
        if (data) host.held += malloc_usable_size(data);
        return data;
    }
    void raw_free(void* data, MemoryKind) override {
        if (!data) return;
        HostCount& host = host_memory();
        std::lock_guard<std::mutex> lock(host.mutex);
        host.held -= std::min(host.held, malloc_usable_size(data));
        std::free(data);
    }
    std::string refusal() const override { return refusal_; }
    std::string state_memory_advice() const override {
        return "a smaller model, or fewer cpu devices: they share the machine's memory (more devices do not add "
               "any), and each holds the whole weights below zero_stage 3";
    }
    void copy_from_host(const Tensor& dst, const void* src) override { std::memcpy(dst.data, src, dst.bytes()); }
    void copy_to_host(void* dst, const Tensor& src) override { std::memcpy(dst, src.data, src.bytes()); }
    void copy_from_device(const Tensor&, const void*, int) override {
        throw InvalidArgument("the cpu backend has no device memory to copy from; pass host (numpy) arrays");
    }
    void copy(const Tensor& dst, const Tensor& src) override {
        if (dst.numel() != src.numel()) throw InternalError("copy between tensors of different sizes");
        // The cpu backend computes in float32 only (its statistics are float64): no conversions.
        if (dst.dtype != src.dtype)
            throw InternalError(std::string("cpu copy from ") + dtype_name(src.dtype) + " to " + dtype_name(dst.dtype));
        std::memcpy(dst.data, src.data, src.bytes());
    }

    void reserve_scratch(NamedAllocator& allocator, const ScratchShapes& s) override {
        const std::vector<Tensor> scratch = allocate_scratch(allocator, cpu_scratch_plan(s, threads_, true));
        attention_scratch_ = scratch[0];
        classifier_scratch_ = scratch[1];
        reduce_scratch_ = scratch[2];
        attention_time_ = s.attention.time;
        classifier_rows_ = s.classifier_rows;
    }
    void fill(const Tensor& t, float value) override {
        if (t.dtype == DType::F64) return fill_values(t.f64(), t.numel(), double(value));
        fill_values(t.f32(), t.numel(), value);
    }
    void synchronize() override {}
    // Host memory is shared with everything else on the machine: no device figure.
    bool memory_info(std::size_t*, std::size_t*) override { return false; }

    void matmul(const Tensor& out, const Tensor& a, const Tensor& b, int M, int N, int K, bool trans_a,
                bool trans_b, bool accumulate) override {
        gemm(out.f32(), a.f32(), b.f32(), M, N, K, trans_a ? M : K, trans_b ? K : N, N, trans_a, trans_b, 1.0f,
             accumulate ? 1.0f : 0.0f);
    }

    void add_bias(const Tensor& out, const Tensor& bias, int rows, int cols) override {
        float* o = out.f32();
        const float* bb = bias.f32();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int r = 0; r < rows; ++r) add_bias_rows(o, bb, r, r + 1, cols);
    }

    void bias_backward(const Tensor& dbias, const Tensor& dout, int rows, int cols) override {
        column_sums(dbias.f32(), dout.f32(), rows, cols);
    }

    void add(const Tensor& out, const Tensor& a, const Tensor& b) override {
        float* o = out.f32();
        const float* x = a.f32();
        const float* y = b.f32();
        const std::int64_t n = out.numel();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
    }

    void accumulate(const Tensor& out, const Tensor& a) override {
        float* o = out.f32();
        const float* x = a.f32();
        const std::int64_t n = out.numel();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) o[i] += x[i];
    }

    void scale_dropout(const Tensor& out, const Tensor& in, float scale, float drop, std::uint64_t seed,
                       const Tensor& seed_base) override {
        if (seed_base.data) seed = dropout_mask_seed(seed, seed_base_value(seed_base));
        float* o = out.f32();
        const float* x = in.f32();
        const std::int64_t n = out.numel();
        const float kept = drop > 0.0f ? scale / (1.0f - drop) : scale;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i)
            o[i] = drop > 0.0f && !dropout_keep(seed, static_cast<std::uint64_t>(i), drop) ? 0.0f : x[i] * kept;
    }

    void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int rows,
                           int channels) override {
        float* o = out.f32();
        const std::int32_t* tok = tokens.i32();
        const float* t = table.f32();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int r = 0; r < rows; ++r)
            std::memcpy(o + static_cast<std::int64_t>(r) * channels, t + static_cast<std::int64_t>(tok[r]) * channels,
                        sizeof(float) * channels);
    }

    void embedding_backward(const Tensor& table_grad, const Tensor& dout, const Tensor& tokens, int rows,
                            int channels) override {
        // Parallel over channels, rows in order: each table entry sums its rows
        // in the same order whatever the thread count.
        float* g = table_grad.f32();
        const float* d = dout.f32();
        const std::int32_t* tok = tokens.i32();
        const int block = 16;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int c0 = 0; c0 < channels; c0 += block) {
            const int c1 = std::min(channels, c0 + block);
            for (int r = 0; r < rows; ++r) {
                float* gr = g + static_cast<std::int64_t>(tok[r]) * channels;
                const float* dr = d + static_cast<std::int64_t>(r) * channels;
                for (int c = c0; c < c1; ++c) gr[c] += dr[c];
            }
        }
    }

    void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, int rows,
                         int channels, float eps) override {
        float* o = out.f32();
        float* rs = rstd.f32();
        const float* x = inp.f32();
        const float* w = weight.f32();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int r = 0; r < rows; ++r) rmsnorm_rows(o, rs, x, w, r, r + 1, channels, eps);
    }

    void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                          const Tensor& weight, const Tensor& rstd, int rows, int channels,
                          bool accumulate) override {
        float* dx = dinp.f32();
        const float* dy = dout.f32();
        const float* x = inp.f32();
        const float* w = weight.f32();
        const float* rs = rstd.f32();
        // dweight first: it reads dout, which dinp may alias.
        column_sums(dweight.f32(), dy, rows, channels, x, rs);
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int r = 0; r < rows; ++r) {
            const std::int64_t off = static_cast<std::int64_t>(r) * channels;
            const float s = rs[r];
            float dot = 0.0f;
            for (int c = 0; c < channels; ++c) dot += dy[off + c] * w[c] * x[off + c] * s;
            dot /= channels;
            for (int c = 0; c < channels; ++c) {
                const float g = s * (dy[off + c] * w[c] - x[off + c] * s * dot);
                dx[off + c] = accumulate ? dx[off + c] + g : g;
            }
        }
    }

    void rope_forward(const Tensor& x, const Tensor& cos_sin, int batch, int time, int heads,
                      int head_dim) override {
        rotate(x.f32(), cos_sin.f32(), batch, time, heads, head_dim, 1.0f);
    }
    void rope_backward(const Tensor& dx, const Tensor& cos_sin, int batch, int time, int heads,
                       int head_dim) override {
        // The rotation is orthogonal: its gradient is the inverse rotation.
        rotate(dx.f32(), cos_sin.f32(), batch, time, heads, head_dim, -1.0f);
    }

    // The keys query t of row b attends (Backend::attention_forward).
    struct KeyRange {
        int first, last;
    };
    static KeyRange visible_keys(const Tensor& positions, const AttentionShape& s, int b, int t) {
        if (!s.causal) return {0, s.time - 1};
        if (!positions.data) return {0, t};
        return {std::max(0, t - positions.i32()[std::int64_t(b) * s.time + t]), t};
    }

    // Attention runs one (batch, head) pair per thread, each with its own
    // [T, T] scratch and single-threaded sgemm calls. Backward goes by kv head
    // so that the heads sharing a kv head accumulate dk/dv in one thread.

    void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& positions, const AttentionShape& s) override {
        const int T = s.time, D = s.head_dim, group = s.heads / s.kv_heads;
        const int ldq = s.heads * D, ldk = s.kv_heads * D;
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        float* scratch = attention_scratch(T);
        const int pairs = s.batch * s.heads;
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
        for (int pair = 0; pair < pairs; ++pair) {
            const int b = pair / s.heads, h = pair % s.heads;
            float* probs = scratch + std::int64_t(omp_get_thread_num()) * T * T;
            const std::int64_t qoff = std::int64_t(b) * T * ldq + h * D;
            const std::int64_t koff = std::int64_t(b) * T * ldk + (h / group) * D;
            gemm_serial(probs, q.f32() + qoff, k.f32() + koff, T, T, D, ldq, ldk, T, false, true, scale, 0.0f);
            float* l = lse.f32() + (std::int64_t(b) * s.heads + h) * T;
            for (int t = 0; t < T; ++t) {
                float* row = probs + std::int64_t(t) * T;
                const KeyRange keys = visible_keys(positions, s, b, t);
                float m = -std::numeric_limits<float>::infinity();
                for (int u = keys.first; u <= keys.last; ++u) m = std::max(m, row[u]);
                float sum = 0.0f;
                for (int u = keys.first; u <= keys.last; ++u) {
                    row[u] = std::exp(row[u] - m);
                    sum += row[u];
                }
                const float inv = 1.0f / sum;
                for (int u = 0; u < keys.first; ++u) row[u] = 0.0f;
                for (int u = keys.first; u <= keys.last; ++u) row[u] *= inv;
                for (int u = keys.last + 1; u < T; ++u) row[u] = 0.0f;
                l[t] = m + std::log(sum);
            }
            gemm_serial(out.f32() + qoff, probs, v.f32() + koff, T, D, T, T, ldk, ldq, false, false, 1.0f, 0.0f);
        }
    }

    // One query over the cache, one head per thread: scores, softmax and the
    // weighted sum of values, without the workspaces.
    void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionShape& s, const Tensor&, const Tensor&) override {
        if (s.batch != 1) throw InternalError("attention_decode attends for one sequence (batch 1)");
        const int T = s.time, D = s.head_dim, group = s.heads / s.kv_heads;
        const std::int64_t ldk = std::int64_t(s.kv_heads) * D;
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        float* scratch = attention_scratch(T);  // [threads, T, T]: row 0 of each thread's block
        const float* keys = k.f32();
        const float* values = v.f32();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int h = 0; h < s.heads; ++h) {
            float* probs = scratch + std::int64_t(omp_get_thread_num()) * T * T;
            const float* qh = q.f32() + std::int64_t(h) * D;
            const std::int64_t kv = std::int64_t(h / group) * D;
            float m = -std::numeric_limits<float>::infinity();
            for (int u = 0; u < T; ++u) {
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) dot += qh[d] * keys[u * ldk + kv + d];
                probs[u] = dot * scale;
                m = std::max(m, probs[u]);
            }
            float sum = 0.0f;
            for (int u = 0; u < T; ++u) {
                probs[u] = std::exp(probs[u] - m);
                sum += probs[u];
            }
            const float inv = 1.0f / sum;
            float* oh = out.f32() + std::int64_t(h) * D;
            for (int d = 0; d < D; ++d) oh[d] = 0.0f;
            for (int u = 0; u < T; ++u) {
                const float p = probs[u] * inv;
                for (int d = 0; d < D; ++d) oh[d] += p * values[u * ldk + kv + d];
            }
        }
    }

    void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                            const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& positions, const AttentionShape& s) override {
        const int T = s.time, D = s.head_dim, group = s.heads / s.kv_heads;
        const int ldq = s.heads * D, ldk = s.kv_heads * D;
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        float* probs_all = attention_scratch(T);
        float* dscores_all = probs_all + std::int64_t(threads_) * T * T;
        const int pairs = s.batch * s.kv_heads;
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
        for (int pair = 0; pair < pairs; ++pair) {
            const int b = pair / s.kv_heads, kv = pair % s.kv_heads;
            float* probs = probs_all + std::int64_t(omp_get_thread_num()) * T * T;
            float* dscores = dscores_all + std::int64_t(omp_get_thread_num()) * T * T;
            const std::int64_t koff = std::int64_t(b) * T * ldk + kv * D;
            for (int h = kv * group; h < (kv + 1) * group; ++h) {
                const std::int64_t qoff = std::int64_t(b) * T * ldq + h * D;
                const float* l = lse.f32() + (std::int64_t(b) * s.heads + h) * T;
                const float* o = out.f32() + qoff;
                const float* dO = dout.f32() + qoff;
                // Recompute the probabilities from the saved log-sum-exp.
                gemm_serial(probs, q.f32() + qoff, k.f32() + koff, T, T, D, ldq, ldk, T, false, true, scale, 0.0f);
                gemm_serial(dscores, dO, v.f32() + koff, T, T, D, ldq, ldk, T, false, true, 1.0f, 0.0f);
                for (int t = 0; t < T; ++t) {
                    float* p = probs + std::int64_t(t) * T;
                    float* ds = dscores + std::int64_t(t) * T;
                    float delta = 0.0f;  // sum_u p[u] dp[u] == dot(dO_t, O_t)
                    for (int d = 0; d < D; ++d) delta += dO[std::int64_t(t) * ldq + d] * o[std::int64_t(t) * ldq + d];
                    const KeyRange keys = visible_keys(positions, s, b, t);
                    for (int u = 0; u < keys.first; ++u) p[u] = ds[u] = 0.0f;
                    for (int u = keys.first; u <= keys.last; ++u) {
                        p[u] = std::exp(p[u] - l[t]);
                        ds[u] = p[u] * (ds[u] - delta) * scale;
                    }
                    for (int u = keys.last + 1; u < T; ++u) p[u] = ds[u] = 0.0f;
                }
                const float first = h == kv * group ? 0.0f : 1.0f;  // overwrite dk/dv on the group's first head
                gemm_serial(dq.f32() + qoff, dscores, k.f32() + koff, T, D, T, T, ldk, ldq, false, false, 1.0f, 0.0f);
                gemm_serial(dk.f32() + koff, dscores, q.f32() + qoff, T, D, T, T, ldq, ldk, true, false, 1.0f, first);
                gemm_serial(dv.f32() + koff, probs, dO, T, D, T, T, ldq, ldk, true, false, 1.0f, first);
            }
        }
    }

    void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override {
        float* o = out.f32();
        const float* g = gate.f32();
        const float* u = up.f32();
        const std::int64_t n = out.numel();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) swiglu_range(o, g, u, i, i + 1);
    }

    void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                         const Tensor& up) override {
        float* dg = dgate.f32();
        float* du = dup.f32();
        const float* d = dout.f32();
        const float* g = gate.f32();
        const float* u = up.f32();
        const std::int64_t n = dout.numel();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) swiglu_backward_range(dg, du, d, g, u, i, i + 1);
    }

    void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& stats, int rows, int vocab,
                       int first_position, int time, float z_loss, bool with_grad) override {
        float* lg = logits.f32();
        const std::int32_t* tg = targets.i32();
        if (rows > classifier_rows_) throw InternalError("classifier chunk larger than reserved");
        float* row_lse = classifier_scratch_.f32();
        float* row_loss = row_lse + classifier_rows_;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int r = 0; r < rows; ++r) {
            float* row = lg + static_cast<std::int64_t>(r) * vocab;
            const int target = tg[r];
            if (target == kIgnoreIndex) {
                if (with_grad) std::memset(row, 0, sizeof(float) * vocab);
                continue;
            }
            float m = -std::numeric_limits<float>::infinity();
            for (int j = 0; j < vocab; ++j) m = std::max(m, row[j]);
            const float target_logit = row[target];
            // With a gradient to write, the exponentials are kept in place
            // and rescaled into softmax * (1 + 2 z lse): one exp per logit.
            float sum = 0.0f;
            if (with_grad) {
                for (int j = 0; j < vocab; ++j) {
                    row[j] = std::exp(row[j] - m);
                    sum += row[j];
                }
            } else {
                for (int j = 0; j < vocab; ++j) sum += std::exp(row[j] - m);
            }
            const float lse = m + std::log(sum);
            row_lse[r] = lse;
            row_loss[r] = lse - target_logit;
            if (with_grad) {
                const float scale = (1.0f + 2.0f * z_loss * lse) / sum;
                for (int j = 0; j < vocab; ++j) row[j] *= scale;
                row[target] -= 1.0f;
            }
        }
        // Sum in row order so the statistics do not depend on the thread count.
        StatValue* st = stats.f64();
        double loss = 0, loss1k = 0, lse_sum = 0, z = 0;
        std::int64_t tokens = 0, tokens1k = 0;
        double lse_max = st[kLseMax];
        for (int r = 0; r < rows; ++r) {
            if (tg[r] == kIgnoreIndex) continue;
            ++tokens;
            loss += row_loss[r];
            lse_sum += row_lse[r];
            lse_max = std::max(lse_max, double(row_lse[r]));
            z += static_cast<double>(z_loss) * row_lse[r] * row_lse[r];
            if ((first_position + r) % time < 1024) {
                ++tokens1k;
                loss1k += row_loss[r];
            }
        }
        st[kLossSum] += loss;
        st[kTokens] += static_cast<double>(tokens);
        st[kLoss1kSum] += loss1k;
        st[kTokens1k] += static_cast<double>(tokens1k);
        st[kLseSum] += lse_sum;
        st[kLseMax] = lse_max;
        st[kZLossSum] += z;
    }

    void sum_squares(const Tensor& out, const Tensor& x) override {
        // Fixed blocks summed in order: the result does not depend on threads.
        const float* p = x.f32();
        const std::int64_t n = x.numel();
        const std::int64_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
        if (2 * blocks > reduce_scratch_.numel()) throw InternalError("sum_squares input larger than reserved");
        double* partial = static_cast<double*>(reduce_scratch_.data);
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t b = 0; b < blocks; ++b) {
            double acc = 0.0;
            for (std::int64_t i = b * kReduceBlock; i < std::min(n, (b + 1) * kReduceBlock); ++i)
                acc += double(p[i]) * p[i];
            partial[b] = acc;
        }
        double total = 0.0;
        for (std::int64_t b = 0; b < blocks; ++b) total += partial[b];
        out.f64()[0] += total;
    }

    void optimizer_scale(const Tensor& out, const Tensor& gathered, int ranks, const Tensor& clip_value) override {
        const StatValue* g = gathered.f64();
        const float grad_clip = static_cast<float>(clip_value.f64()[0]);
        double tokens = 0.0, squares = 0.0, loss = 0.0;
        for (int r = 0; r < ranks; ++r) {
            tokens += g[r * kGatherStride + kTokens];
            squares += g[r * kGatherStride + kSumSquaresSlot];
            loss += g[r * kGatherStride + kLossSum];
        }
        float* o = out.f32();
        o[2] = std::isfinite(squares) && std::isfinite(loss) ? 0.0f : 1.0f;
        if (tokens == 0.0) {  // no counted token: skipped (see Backend::optimizer_scale)
            o[0] = o[1] = 0.0f;
            o[2] = 1.0f;
            return;
        }
        const double norm = std::sqrt(squares) / tokens;
        const double clip = grad_clip > 0 && norm > grad_clip ? grad_clip / norm : 1.0;
        o[0] = static_cast<float>(clip / tokens);
        o[1] = static_cast<float>(norm);
    }

    void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& scale,
               const AdamWStep& s) override {
        float* p = param.f32();
        const float* g = grad.f32();
        float* mm = m.f32();
        float* vv = v.f32();
        if (scale.f32()[2] != 0.0f) return;  // a non-finite loss or gradient: the update is skipped
        const float grad_scale = scale.f32()[0];
        const std::int64_t n = param.numel();
        const float bias1 = 1.0f - std::pow(s.beta1, static_cast<float>(s.step));
        const float bias2_sqrt = std::sqrt(1.0f - std::pow(s.beta2, static_cast<float>(s.step)));
        const float step_size = s.lr / bias1;
        const float decay = 1.0f - s.lr * s.weight_decay;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) {
            const float gi = g[i] * grad_scale;
            mm[i] = s.beta1 * mm[i] + (1.0f - s.beta1) * gi;
            vv[i] = s.beta2 * vv[i] + (1.0f - s.beta2) * gi * gi;
            p[i] = p[i] * decay - step_size * mm[i] / (std::sqrt(vv[i]) / bias2_sqrt + s.eps);
        }
    }

    // ---- Fused composites ------------------------------------------------
    // Each thread computes its block of rows of the matmuls (the block
    // gemm() would give it, so the products are bitwise the unfused ones)
    // and runs the row-wise steps on those rows while they are in its cache,
    // in one parallel region instead of one per op. Where gemm() would split
    // a product along N instead (fewer rows than columns) the default runs.

    void residual_rmsnorm_forward(const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                                  const Tensor& residual, const Tensor& delta, const Tensor& weight, int rows,
                                  int channels, float eps) override {
        float* sum = residual_out.f32();
        const float* r = residual.f32();
        const float* d = delta.f32();
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int row = 0; row < rows; ++row) {
            const std::int64_t off = std::int64_t(row) * channels;
            for (int c = 0; c < channels; ++c) sum[off + c] = r[off + c] + d[off + c];
            rmsnorm_rows(out.f32(), rstd.f32(), sum, weight.f32(), row, row + 1, channels, eps);
        }
    }

    void qkv_forward(const QkvActivations& a, const Tensor& x, const QkvWeights& w, const Tensor& cos_sin,
                     const QkvShape& s) override {
        const AttentionShape& t = s.attention;
        const int rows = t.batch * t.time, C = s.hidden, D = t.head_dim;
        const int widths[3] = {t.heads * D, t.kv_heads * D, t.kv_heads * D};
        if (rows < widths[0] || rows < widths[1]) return Backend::qkv_forward(a, x, w, cos_sin, s);
        const bool norms = w.q_norm.data != nullptr;
        float* outs[3] = {(norms ? a.q_raw : a.q).f32(), (norms ? a.k_raw : a.k).f32(), a.v.f32()};
        const float* weights = w.qkv.f32();
        const float* bias = w.qkv_bias.data ? w.qkv_bias.f32() : nullptr;
        const int parts = gemm_parts(rows, widths[0]);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
        for (int part = 0; part < parts; ++part) {
            const int begin = part_begin(rows, part, parts), end = part_begin(rows, part + 1, parts);
            if (begin == end) continue;
            std::int64_t first = 0;  // the projection's first row in the packed weight
            for (int i = 0; i < 3; ++i) {
                gemm_serial(outs[i] + std::int64_t(begin) * widths[i], x.f32() + std::int64_t(begin) * C,
                            weights + first * C, end - begin, widths[i], C, C, C, widths[i], false, true, 1.0f, 0.0f);
                if (bias) add_bias_rows(outs[i], bias + first, begin, end, widths[i]);
                first += widths[i];
            }
            if (norms) {
                rmsnorm_rows(a.q.f32(), a.q_rstd.f32(), a.q_raw.f32(), w.q_norm.f32(), std::int64_t(begin) * t.heads,
                             std::int64_t(end) * t.heads, D, s.eps);
                rmsnorm_rows(a.k.f32(), a.k_rstd.f32(), a.k_raw.f32(), w.k_norm.f32(),
                             std::int64_t(begin) * t.kv_heads, std::int64_t(end) * t.kv_heads, D, s.eps);
            }
            rotate_rows(a.q.f32(), cos_sin.f32(), begin, end, t.time, t.heads, D, 1.0f);
            rotate_rows(a.k.f32(), cos_sin.f32(), begin, end, t.time, t.kv_heads, D, 1.0f);
        }
    }

    void qkv_backward(const Tensor& dx, bool accumulate, const QkvWeights& g, const Tensor& dq, const Tensor& dk,
                      const Tensor& dv, const QkvActivations& a, const Tensor& x, const QkvWeights& w,
                      const Tensor& cos_sin, const QkvShape& s) override {
        const AttentionShape& t = s.attention;
        const int rows = t.batch * t.time, C = s.hidden, D = t.head_dim;
        // The q/k norms' weight gradients sum over all rows (not row-local):
        // with them the default runs.
        if (w.q_norm.data || rows < C) return Backend::qkv_backward(dx, accumulate, g, dq, dk, dv, a, x, w, cos_sin, s);
        const int widths[3] = {t.heads * D, t.kv_heads * D, t.kv_heads * D};
        float* dys[3] = {dq.f32(), dk.f32(), dv.f32()};
        const float* weights = w.qkv.f32();
        const int parts = gemm_parts(rows, C);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
        for (int part = 0; part < parts; ++part) {
            const int begin = part_begin(rows, part, parts), end = part_begin(rows, part + 1, parts);
            if (begin == end) continue;
            rotate_rows(dys[0], cos_sin.f32(), begin, end, t.time, t.heads, D, -1.0f);
            rotate_rows(dys[1], cos_sin.f32(), begin, end, t.time, t.kv_heads, D, -1.0f);
            std::int64_t first = 0;
            for (int i = 0; i < 3; ++i) {
                gemm_serial(dx.f32() + std::int64_t(begin) * C, dys[i] + std::int64_t(begin) * widths[i],
                            weights + first * C, end - begin, C, widths[i], widths[i], C, C, false, false, 1.0f,
                            accumulate || i > 0 ? 1.0f : 0.0f);
                first += widths[i];
            }
        }
        if (!g.qkv.data) return;
        std::int64_t first = 0;
        for (int i = 0; i < 3; ++i) {
            const Tensor dweight = g.qkv.slice(first * C, std::int64_t(widths[i]) * C);
            const Tensor dbias = g.qkv_bias.data ? g.qkv_bias.slice(first, widths[i]) : Tensor();
            matmul_weight_grad(dweight, dbias, i == 0 ? dq : i == 1 ? dk : dv, x, rows, widths[i], C);
            first += widths[i];
        }
    }

    void gate_up_swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up, const Tensor& x,
                                const Tensor& gate_up, int rows, int intermediate, int channels) override {
        if (rows < intermediate)
            return Backend::gate_up_swiglu_forward(out, gate, up, x, gate_up, rows, intermediate, channels);
        const int I = intermediate, C = channels, parts = gemm_parts(rows, I);
        float* halves[2] = {gate.f32(), up.f32()};
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
        for (int part = 0; part < parts; ++part) {
            const int begin = part_begin(rows, part, parts), end = part_begin(rows, part + 1, parts);
            if (begin == end) continue;
            for (int i = 0; i < 2; ++i)
                gemm_serial(halves[i] + std::int64_t(begin) * I, x.f32() + std::int64_t(begin) * C,
                            gate_up.f32() + std::int64_t(i) * I * C, end - begin, I, C, C, C, I, false, true, 1.0f,
                            0.0f);
            swiglu_range(out.f32(), halves[0], halves[1], std::int64_t(begin) * I, std::int64_t(end) * I);
        }
    }

    void swiglu_gate_up_backward(const Tensor& dx, bool accumulate, const Tensor& dgate_up, const Tensor& dgate,
                                 const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                                 const Tensor& x, const Tensor& gate_up, int rows, int intermediate,
                                 int channels) override {
        const int I = intermediate, C = channels;
        if (rows < C)
            return Backend::swiglu_gate_up_backward(dx, accumulate, dgate_up, dgate, dup, dout, gate, up, x, gate_up,
                                                    rows, I, C);
        float* dys[2] = {dgate.f32(), dup.f32()};
        const int parts = gemm_parts(rows, C);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
        for (int part = 0; part < parts; ++part) {
            const int begin = part_begin(rows, part, parts), end = part_begin(rows, part + 1, parts);
            if (begin == end) continue;
            swiglu_backward_range(dys[0], dys[1], dout.f32(), gate.f32(), up.f32(), std::int64_t(begin) * I,
                                  std::int64_t(end) * I);
            for (int i = 0; i < 2; ++i)
                gemm_serial(dx.f32() + std::int64_t(begin) * C, dys[i] + std::int64_t(begin) * I,
                            gate_up.f32() + std::int64_t(i) * I * C, end - begin, C, I, I, C, C, false, false, 1.0f,
                            accumulate || i > 0 ? 1.0f : 0.0f);
        }
        if (!dgate_up.data) return;
        for (int i = 0; i < 2; ++i)
            matmul_weight_grad(dgate_up.slice(std::int64_t(i) * I * C, std::int64_t(I) * C), Tensor(),
                               i == 0 ? dgate : dup, x, rows, I, C);
    }

private:
    // Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C, split into one
    // block per thread along the larger of M and N.
    // How gemm() splits an [M, N] product: into this many parts, along M
    // when M >= N (else along N); part p covers [extent * p / parts,
    // extent * (p + 1) / parts).
    int gemm_parts(int M, int N) const { return std::min(threads_, std::max(M, N) >= 64 ? threads_ : 1); }
    static int part_begin(int extent, int part, int parts) {
        return static_cast<int>(std::int64_t(extent) * part / parts);
    }

    void gemm(float* c, const float* a, const float* b, int M, int N, int K, int lda, int ldb, int ldc, bool trans_a,
              bool trans_b, float alpha, float beta) {
        const int parts = gemm_parts(M, N);
        const bool split_m = M >= N;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
        for (int part = 0; part < parts; ++part) {
            const int extent = split_m ? M : N;
            const int begin = part_begin(extent, part, parts);
            const int end = part_begin(extent, part + 1, parts);
            if (begin == end) continue;
            if (split_m)
                gemm_serial(c + std::int64_t(begin) * ldc, a + (trans_a ? begin : std::int64_t(begin) * lda), b,
                            end - begin, N, K, lda, ldb, ldc, trans_a, trans_b, alpha, beta);
            else
                gemm_serial(c + begin, a, b + (trans_b ? std::int64_t(begin) * ldb : begin), M, end - begin, K, lda,
                            ldb, ldc, trans_a, trans_b, alpha, beta);
        }
    }

    void gemm_serial(float* c, const float* a, const float* b, int M, int N, int K, int lda, int ldb, int ldc,
                     bool trans_a, bool trans_b, float alpha, float beta) const {
#ifdef NANOQ_HAVE_OPENBLAS
        if (openblas_) {
            scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                              M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
#endif
        portable_sgemm(c, a, b, M, N, K, lda, ldb, ldc, trans_a, trans_b, alpha, beta);
    }

    // out[c] += a sum over rows, parallel over columns with rows in
    // order: sums of dout, or with `inp`, the rmsnorm weight gradient
    // dout * inp * rstd.
    void column_sums(float* out, const float* dout, int rows, int cols, const float* inp = nullptr,
                     const float* rstd = nullptr) {
        const int block = 16;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (int c0 = 0; c0 < cols; c0 += block) {
            const int c1 = std::min(cols, c0 + block);
            float acc[block] = {};
            for (int r = 0; r < rows; ++r) {
                const std::int64_t off = static_cast<std::int64_t>(r) * cols;
                for (int c = c0; c < c1; ++c)
                    acc[c - c0] += inp ? dout[off + c] * inp[off + c] * rstd[r] : dout[off + c];
            }
            for (int c = c0; c < c1; ++c) out[c] += acc[c - c0];
        }
    }

    void rotate(float* x, const float* cos_sin, int batch, int time, int heads, int head_dim, float direction) {
        const std::int64_t rows = static_cast<std::int64_t>(batch) * time;
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t r = 0; r < rows; ++r) rotate_rows(x, cos_sin, r, r + 1, time, heads, head_dim, direction);
    }

    // The serial bodies of the row-wise and elementwise ops, over rows (or
    // elements) [begin, end): the primitives run them one row per OpenMP
    // iteration, the fused composites on each thread's block of a matmul's
    // rows. One definition each, so fused and unfused results are bitwise
    // equal (which recompute relies on).
    static void add_bias_rows(float* o, const float* bias, std::int64_t begin, std::int64_t end, int cols) {
        for (std::int64_t r = begin; r < end; ++r)
            for (int c = 0; c < cols; ++c) o[r * cols + c] += bias[c];
    }
    static void rmsnorm_rows(float* o, float* rs, const float* x, const float* w, std::int64_t begin,
                             std::int64_t end, int channels, float eps) {
        for (std::int64_t r = begin; r < end; ++r) {
            const float* xr = x + r * channels;
            float* orow = o + r * channels;
            float sum = 0.0f;
            for (int c = 0; c < channels; ++c) sum += xr[c] * xr[c];
            const float s = 1.0f / std::sqrt(sum / channels + eps);
            rs[r] = s;
            for (int c = 0; c < channels; ++c) orow[c] = w[c] * (xr[c] * s);
        }
    }
    static void rotate_rows(float* x, const float* cos_sin, std::int64_t begin, std::int64_t end, int time,
                            int heads, int head_dim, float direction) {
        const int half = head_dim / 2;
        for (std::int64_t r = begin; r < end; ++r) {
            const float* cs = cos_sin + static_cast<std::int64_t>(r % time) * half * 2;
            for (int h = 0; h < heads; ++h) {
                float* xh = x + (r * heads + h) * head_dim;
                for (int i = 0; i < half; ++i) {
                    const float c = cs[2 * i], sn = direction * cs[2 * i + 1];
                    const float a = xh[i], b = xh[i + half];
                    xh[i] = a * c - b * sn;
                    xh[i + half] = b * c + a * sn;
                }
            }
        }
    }
    static void swiglu_range(float* o, const float* g, const float* u, std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
    static void swiglu_backward_range(float* dg, float* du, const float* d, const float* g, const float* u,
                                      std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) {
            const float sig = 1.0f / (1.0f + std::exp(-g[i]));
            const float silu = g[i] * sig;
            const float di = d[i];
            du[i] = di * silu;
            dg[i] = di * u[i] * (sig + silu * (1.0f - sig));
        }
    }

    float* attention_scratch(int time) const {
        if (attention_time_ < time) throw InternalError("attention longer than reserved");
        return attention_scratch_.f32();
    }

    template <class T>
    void fill_values(T* p, std::int64_t n, T value) {
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t i = 0; i < n; ++i) p[i] = value;
    }

    std::string refusal_;  // why raw_alloc last refused ("" when it did not)
    int threads_;
    bool openblas_;              // sgemm by OpenBLAS, else portable_sgemm (cpu_gemm() chose at construction)
    Tensor attention_scratch_;   // [2, threads, T, T]: probabilities and their gradients
    Tensor classifier_scratch_;  // [2, rows]: per-row lse and loss
    Tensor reduce_scratch_;      // double partial sums of sum_squares
    int attention_time_ = 0;     // the T and rows above
    int classifier_rows_ = 0;
};

}  // namespace

std::vector<ScratchBuffer> cpu_scratch_plan(const ScratchShapes& s, int threads, bool /*ask_libraries*/) {
    const std::int64_t T = s.attention.time;
    const std::int64_t blocks = (s.max_reduce + kReduceBlock - 1) / kReduceBlock;
    return {
        {"attention-scratch", DType::F32, 2 * std::int64_t(std::max(1, threads)) * T * T, MemoryKind::Device, true},
        {"classifier-rows", DType::F32, 2 * std::int64_t(s.classifier_rows), MemoryKind::Device, true},
        {"sum-squares-partials", DType::F32, 2 * blocks, MemoryKind::Device, true},  // doubles
    };
}

std::unique_ptr<Backend> create_cpu_backend(int /*device*/, int threads) {
    return std::make_unique<CpuBackend>(threads);
}

}  // namespace nanoq
