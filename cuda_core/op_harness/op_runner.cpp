// OpRunner: any op of the table on host arrays (see op_runner.h).
//
// A call is resolved in three steps: scalars (given, or their defaults),
// then the ints named by the shapes (bound from the given tensors, checked
// across them), then the shapes of the tensors the op creates. Only then is
// anything allocated: a fresh NamedAllocator whose scratch is reserved for
// this call's shapes alone, the staged inputs, and the results copied back.
#include "op_harness/op_runner.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>

#include "op_harness/op_spec.h"
#include "stat_slots.h"

namespace nanoq::ops {

static_assert(std::is_same<StatValue, double>::value, "op_runner.h passes statistics as float64");

// -- shapes --------------------------------------------------------------------

namespace {

void require(bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument(what);
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
    std::string s = "(";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + (shape.size() == 1 ? ",)" : ")");
}

std::vector<std::string> split(const std::string& text, char sep) {
    std::vector<std::string> parts;
    std::stringstream in(text);
    std::string part;
    while (std::getline(in, part, sep)) parts.push_back(part);
    return parts;
}

struct Dim {
    std::string name;  // empty: a literal
    std::int64_t literal = 0;
    std::int64_t divisor = 1;
};

struct Shape {
    std::string text;  // as written, for messages
    std::string star;  // group of the leading dimensions, if any
    std::vector<Dim> dims;
};

// One branch of a shape string (no '?').
Shape parse_shape(const std::string& text) {
    Shape s;
    s.text = "[" + text + "]";
    for (std::string item : split(text, ',')) {
        if (item.empty()) throw std::logic_error("op table: empty dimension in shape " + text);
        if (item[0] == '*') {
            if (!s.dims.empty() || !s.star.empty()) throw std::logic_error("op table: '*' must come first in " + text);
            s.star = item.substr(1);
            continue;
        }
        Dim d;
        const std::size_t slash = item.find('/');
        if (std::isdigit(static_cast<unsigned char>(item[0]))) {
            d.literal = std::stoll(item);
        } else {
            d.name = item.substr(0, slash);
            if (slash != std::string::npos) d.divisor = std::stoll(item.substr(slash + 1));
        }
        s.dims.push_back(d);
    }
    return s;
}

std::size_t host_size(HostType t) { return t == HostType::F64 ? 8 : 4; }

std::int64_t product(const std::vector<std::int64_t>& dims, std::size_t begin, std::size_t end) {
    std::int64_t n = 1;
    for (std::size_t i = begin; i < end; ++i) n *= dims[i];
    return n;
}


DType parse_dtype(const std::string& arg, const std::string& value) {
    if (value == "fp32") return DType::F32;
    if (value == "bf16") return DType::BF16;
    throw InvalidArgument(arg + " must be \"fp32\" or \"bf16\", got \"" + value + "\"");
}

// -- one call ------------------------------------------------------------------

class BoundCall final : public OpCall {
public:
    BoundCall(const OpSpec& spec, Backend& backend, const std::string& backend_name)
        : spec_(spec), backend_(backend), backend_name_(backend_name) {}

    Backend& backend() override { return backend_; }

    const Tensor& operator[](const std::string& name) const override {
        return find(device_, name, "tensor");
    }
    bool given(const std::string& name) const override { return given_.count(name) > 0; }
    bool has(const std::string& name) const override { return device_.count(name) > 0; }
    int i(const std::string& name) const override { return static_cast<int>(find(ints_, name, "int").value); }
    float f(const std::string& name) const override { return static_cast<float>(find(floats_, name, "float")); }
    bool b(const std::string& name) const override { return find(bools_, name, "bool"); }
    DType dtype(const std::string& dtype_arg) const override { return find(dtypes_, dtype_arg, "dtype"); }
    std::uint64_t seed(const std::string& name) const override { return find(seeds_, name, "seed"); }

    // Both keep what they made by name, so that a timed call (repeats > 0)
    // allocates and copies only on its first run of the op.
    Tensor upload(const std::vector<float>& values, const std::string& name) override {
        auto kept = uploads_.find(name);
        if (kept != uploads_.end() && kept->second.first == values) return kept->second.second;
        Tensor t = allocator_->allocate(Context::Workspace, name, DType::F32, {std::int64_t(values.size())});
        backend_.copy_from_host(t, values.data());
        uploads_[name] = {values, t};
        return t;
    }
    Tensor upload_f64(const std::vector<double>& values, const std::string& name) override {
        auto kept = uploads_f64_.find(name);
        if (kept != uploads_f64_.end() && kept->second.first == values) return kept->second.second;
        Tensor t = allocator_->allocate(Context::Workspace, name, DType::F64, {std::int64_t(values.size())});
        backend_.copy_from_host(t, values.data());
        uploads_f64_[name] = {values, t};
        return t;
    }
    Tensor workspace(std::int64_t elements, const std::string& dtype_arg, const std::string& name) override {
        auto kept = workspaces_.find(name);
        if (kept != workspaces_.end() && kept->second.numel() == elements && kept->second.dtype == dtypes_.at(dtype_arg))
            return kept->second;
        return workspaces_[name] = allocator_->allocate(Context::Workspace, name, dtypes_.at(dtype_arg), {elements});
    }

    // Resolves every argument; throws InvalidArgument for a bad call.
    void bind(const std::vector<HostArray>& given, const Scalars& scalars) {
        for (const HostArray& a : given) {
            const ArgSpec& spec = arg(a.name, "tensor");
            require(is_tensor(spec.role) && spec.role != ArgRole::Output,
                    spec_.name + ": " + a.name + " is not an input tensor");
            require(a.type == host_type(spec), spec_.name + ": " + a.name + " must be a " +
                                                   host_dtype_name(host_type(spec)) + " array");
            given_[a.name] = &a;
        }
        bind_scalars(scalars);
        for (const auto& [name, value] : spec_.constants) ints_[name] = Bound{value, "the op"};
        for (const ArgSpec& a : spec_.args) {
            if (!a.given_flag.empty()) bools_[a.given_flag] = given_.count(a.name) > 0;
        }
        for (const ArgSpec& a : spec_.args) {
            if (a.role != ArgRole::Bool || a.alias_target.empty() || !bools_[a.name]) continue;
            require(!given_.count(a.alias_target), spec_.name + ": " + a.alias_target + " cannot be given with " +
                                                       a.name + "=True (" + a.alias_target + " is then " +
                                                       a.alias_source + "'s device tensor)");
            aliased_[a.alias_target] = a.alias_source;
        }
        for (const ArgSpec& a : spec_.args) {
            if (is_tensor(a.role) && given_.count(a.name)) bind_dims(a, *given_[a.name]);
        }
        for (const ArgSpec& a : spec_.args) {
            if (a.role != ArgRole::Int || ints_.count(a.name)) continue;
            require(!a.default_from.empty(), spec_.name + ": missing argument " + a.name);
            ints_[a.name] = Bound{find(ints_, a.default_from, "int").value, "the default"};
        }
        for (const ArgSpec& a : spec_.args) {
            if (a.role == ArgRole::Int) {
                const std::int64_t v = ints_[a.name].value;
                require(v >= a.minimum,
                        spec_.name + ": " + a.name + " must be >= " + std::to_string(a.minimum) + ", got " +
                            std::to_string(v));
            }
        }
        for (const auto& [name, bound] : ints_) {
            require(bound.value >= INT_MIN && bound.value <= INT_MAX,
                    spec_.name + ": " + name + " = " + std::to_string(bound.value) + " does not fit an int");
        }
        for (const ArgSpec& a : spec_.args) {
            if (!is_tensor(a.role)) continue;
            if (given_.count(a.name)) {
                check_dims(a, *given_[a.name]);
                if (!a.token_bound.empty()) check_tokens(a, *given_[a.name]);
            } else {
                require(a.role == ArgRole::Output || a.when_missing != WhenMissing::Required,
                        spec_.name + ": missing argument " + a.name);
                if (a.when_missing != WhenMissing::Absent) shapes_[a.name] = shape_of(a);
            }
        }
        if (spec_.check) spec_.check(*this);
        for (const auto& [name, dtype] : dtypes_) {
            require(!(dtype == DType::BF16 && backend_name_ == "cpu"),
                    "the cpu backend computes in float32 only; use " + name + " fp32");
        }
    }

    // Stages the tensors, runs the op and returns its results. With repeats
    // > 0 the op runs once more first, then `repeats` times back to back on
    // the same tensors, timed from the device being idle to it being done
    // again: *seconds is the mean time of one run (the results are then
    // those of the last run).
    std::vector<HostResult> execute(int device, int repeats = 0, double* seconds = nullptr) {
        allocator_ = std::make_unique<NamedAllocator>(backend_, device);
        backend_.reserve_scratch(*allocator_, spec_.scratch ? spec_.scratch(*this) : no_scratch());
        std::map<std::string, HostResult> results;
        for (const ArgSpec& a : spec_.args) {
            if (!is_tensor(a.role) || aliased_.count(a.name)) continue;
            const DType dtype = a.has_fixed ? a.fixed : dtypes_.at(a.dtype_arg);
            auto given = given_.find(a.name);
            if (a.role == ArgRole::Input) {
                device_[a.name] = given == given_.end() ? Tensor()  // an optional input left out
                                                        : stage(given->second->data, given->second->shape, dtype, a);
                continue;
            }
            HostResult& r = results[a.name];
            r.name = a.name;
            r.type = host_type(a);
            r.shape = given != given_.end() ? given->second->shape : shapes_.at(a.name);
            r.bytes.assign(static_cast<std::size_t>(product(r.shape, 0, r.shape.size())) * host_size(r.type), 0);
            if (given != given_.end()) {
                std::memcpy(r.bytes.data(), given->second->data, r.bytes.size());
            } else if (a.when_missing == WhenMissing::StatInit) {
                reinterpret_cast<StatValue*>(r.bytes.data())[kLseMax] = -std::numeric_limits<StatValue>::infinity();
            }
            if (given == given_.end() && (a.role == ArgRole::Output || a.when_missing == WhenMissing::Output)) {
                const std::int64_t n = product(r.shape, 0, r.shape.size());
                Tensor t = allocator_->allocate(Context::Workspace, a.name, dtype, {n});
                backend_.fill(t, std::numeric_limits<float>::quiet_NaN());
                device_[a.name] = t;
            } else {
                device_[a.name] = stage(r.bytes.data(), r.shape, dtype, a);
            }
        }
        for (const auto& [target, source] : aliased_) {
            HostResult& r = results[target];
            r.name = target;
            r.type = host_type(arg(target, "tensor"));
            r.shape = shapes_.at(target);
            r.bytes.assign(static_cast<std::size_t>(product(r.shape, 0, r.shape.size())) * host_size(r.type), 0);
            device_[target] = device_.at(source);
        }
        spec_.run(*this);
        if (repeats > 0) {
            backend_.synchronize();
            const auto start = std::chrono::steady_clock::now();
            for (int i = 0; i < repeats; ++i) spec_.run(*this);
            backend_.synchronize();
            *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats;
        }
        for (auto& [name, r] : results) {
            Tensor source = device_.at(name);
            if (source.dtype == DType::BF16) {
                Tensor wide = allocator_->allocate(Context::Workspace, name + "-float32", DType::F32, {source.numel()});
                backend_.copy(wide, source);
                source = wide;
            }
            backend_.copy_to_host(r.bytes.data(), source);
        }
        backend_.synchronize();
        std::vector<HostResult> out;
        for (const std::string& name : result_names()) out.push_back(std::move(results.at(name)));
        return out;
    }

private:
    struct Bound {
        std::int64_t value;
        std::string source;  // what set it, for messages
    };

    template <typename Map>
    const typename Map::mapped_type& find(const Map& map, const std::string& name, const char* what) const {
        auto it = map.find(name);
        if (it == map.end()) throw std::logic_error("op table: " + spec_.name + " has no " + what + " " + name);
        return it->second;
    }

    const ArgSpec& arg(const std::string& name, const char* what) const {
        for (const ArgSpec& a : spec_.args)
            if (a.name == name) return a;
        throw InvalidArgument(spec_.name + " has no " + what + " argument " + name);
    }

    std::vector<std::string> result_names() const {
        if (!spec_.results.empty()) return spec_.results;
        std::vector<std::string> names;
        for (const ArgSpec& a : spec_.args)
            if (a.role == ArgRole::InOut || a.role == ArgRole::Output) names.push_back(a.name);
        return names;
    }

    void bind_scalars(const Scalars& s) {
        auto check_role = [&](const std::string& name, ArgRole role, const char* what) {
            require(arg(name, what).role == role, spec_.name + ": " + name + " is not a " + what + " argument");
        };
        for (const auto& [name, v] : s.ints) {
            check_role(name, ArgRole::Int, "int");
            ints_[name] = Bound{v, "argument " + name};
        }
        for (const auto& [name, v] : s.floats) {
            check_role(name, ArgRole::Float, "float");
            floats_[name] = v;
        }
        for (const auto& [name, v] : s.bools) {
            check_role(name, ArgRole::Bool, "bool");
            bools_[name] = v;
        }
        for (const auto& [name, v] : s.seeds) {
            check_role(name, ArgRole::Seed, "seed");
            seeds_[name] = v;
        }
        for (const auto& [name, v] : s.dtypes) {
            if (name != "dtype") check_role(name, ArgRole::DTypeName, "dtype");  // "dtype" may be implicit
            dtypes_[name] = parse_dtype(name, v);
        }
        for (const ArgSpec& a : spec_.args) {
            const bool missing_default = !a.has_default && a.default_from.empty();
            switch (a.role) {
                case ArgRole::Float:
                    if (!floats_.count(a.name)) {
                        require(!missing_default, spec_.name + ": missing argument " + a.name);
                        floats_[a.name] = a.default_value;
                    }
                    break;
                case ArgRole::Bool:
                    if (!bools_.count(a.name)) bools_[a.name] = a.default_value != 0.0;
                    break;
                case ArgRole::Seed:
                    if (!seeds_.count(a.name)) {
                        require(!missing_default, spec_.name + ": missing argument " + a.name);
                        seeds_[a.name] = static_cast<std::uint64_t>(a.default_value);
                    }
                    break;
                case ArgRole::Int:  // after the shapes: a default may name one of their ints
                    if (!ints_.count(a.name) && a.has_default)
                        ints_[a.name] = Bound{static_cast<std::int64_t>(a.default_value), "the default"};
                    break;
                default: break;
            }
        }
        for (const ArgSpec& a : spec_.args) {  // dtypes: defaults may name other dtypes
            if (a.role == ArgRole::DTypeName && !dtypes_.count(a.name) && a.has_default) dtypes_[a.name] = DType::F32;
        }
        for (const ArgSpec& a : spec_.args) {
            if (a.role == ArgRole::DTypeName && !dtypes_.count(a.name))
                dtypes_[a.name] = find(dtypes_, a.default_from, "dtype");
        }
        for (const ArgSpec& a : spec_.args) {  // the implicit activation dtype
            if (is_tensor(a.role) && !a.has_fixed && !dtypes_.count(a.dtype_arg)) {
                require(a.dtype_arg == "dtype", "op table: " + spec_.name + " has no dtype argument " + a.dtype_arg);
                dtypes_["dtype"] = DType::F32;
            }
        }
    }

    Shape branch(const ArgSpec& a) const {
        const std::size_t q = a.shape.find('?');
        if (q == std::string::npos) return parse_shape(a.shape);
        const std::size_t colon = a.shape.find(':', q);
        const bool pick = find(bools_, a.shape.substr(0, q), "bool");
        return parse_shape(pick ? a.shape.substr(q + 1, colon - q - 1) : a.shape.substr(colon + 1));
    }

    std::string mismatch(const ArgSpec& a, const HostArray& given, const Shape& s) const {
        return spec_.name + ": " + a.name + " has shape " + shape_text(given.shape) + "; expected " + s.text;
    }

    void bind_int(const std::string& name, std::int64_t value, const ArgSpec& a, const HostArray& given,
                  const Shape& s) {
        auto it = ints_.find(name);
        if (it == ints_.end()) {
            ints_[name] = Bound{value, a.name};
            return;
        }
        require(it->second.value == value, mismatch(a, given, s) + " with " + name + " = " +
                                               std::to_string(it->second.value) + " (from " + it->second.source + ")");
    }

    void bind_dims(const ArgSpec& a, const HostArray& given) {
        const Shape s = branch(a);
        const std::size_t ndim = given.shape.size();
        const std::size_t lead = ndim >= s.dims.size() ? ndim - s.dims.size() : 0;
        require(s.star.empty() ? ndim == s.dims.size() : ndim >= s.dims.size(),
                mismatch(a, given, s) + " (" + std::to_string(s.dims.size()) + (s.star.empty() ? "" : " or more") +
                    " dimensions)");
        const std::int64_t numel = product(given.shape, 0, ndim);
        require(numel > 0, spec_.name + ": " + a.name + " is empty (shape " + shape_text(given.shape) + ")");
        if (!s.star.empty()) {
            std::vector<std::int64_t> leading(given.shape.begin(), given.shape.begin() + lead);
            auto group = groups_.find(s.star);
            if (group == groups_.end()) {
                groups_[s.star] = {leading, a.name};
            } else {
                require(group->second.first == leading,
                        mismatch(a, given, s) + " with leading dimensions " + shape_text(group->second.first) +
                            " (as " + group->second.second + ")");
            }
            bind_int(s.star, product(leading, 0, leading.size()), a, given, s);
        }
        for (std::size_t j = 0; j < s.dims.size(); ++j) {
            const Dim& d = s.dims[j];
            if (!d.name.empty() && d.divisor == 1) bind_int(d.name, given.shape[lead + j], a, given, s);
        }
    }

    std::int64_t value_of(const Dim& d) const {
        if (d.name.empty()) return d.literal;
        const Bound& b = find(ints_, d.name, "int");
        require(b.value % d.divisor == 0, spec_.name + ": " + d.name + " (" + std::to_string(b.value) +
                                              ") must be divisible by " + std::to_string(d.divisor));
        return b.value / d.divisor;
    }

    void check_dims(const ArgSpec& a, const HostArray& given) const {
        const Shape s = branch(a);
        const std::size_t lead = given.shape.size() - s.dims.size();
        for (std::size_t j = 0; j < s.dims.size(); ++j) {
            const std::int64_t want = value_of(s.dims[j]);
            require(given.shape[lead + j] == want, mismatch(a, given, s) + " with " +
                                                       (s.dims[j].name.empty() ? "" : s.dims[j].name + " = ") +
                                                       std::to_string(want));
        }
    }

    std::vector<std::int64_t> shape_of(const ArgSpec& a) const {
        const Shape s = branch(a);
        std::vector<std::int64_t> shape;
        if (!s.star.empty()) {
            auto group = groups_.find(s.star);
            if (group != groups_.end()) {
                shape = group->second.first;
            } else {
                shape.push_back(find(ints_, s.star, "int").value);
            }
        }
        for (const Dim& d : s.dims) shape.push_back(value_of(d));
        return shape;
    }

    void check_tokens(const ArgSpec& a, const HostArray& given) const {
        const std::int64_t bound = find(ints_, a.token_bound, "int").value;
        const std::int64_t n = product(given.shape, 0, given.shape.size());
        const auto* values = static_cast<const std::int32_t*>(given.data);
        for (std::int64_t r = 0; r < n; ++r) {
            const std::int32_t token = values[r];
            if (a.allow_ignore && token == kIgnoreIndex) continue;
            const std::string range = "[0, " + (a.token_bound == "vocab" ? "vocab_size" : a.token_bound) + " " +
                                      std::to_string(bound) + ")";
            require(token >= 0 && token < bound, a.name + "[" + std::to_string(r) + "] = " + std::to_string(token) +
                                                     " is outside " + range + (a.allow_ignore ? " and not -100" : ""));
        }
    }

    // Host values (float32, or the fixed dtype's) as a device tensor of `dtype`.
    Tensor stage(const void* host, const std::vector<std::int64_t>& shape, DType dtype, const ArgSpec& a) {
        const std::int64_t n = product(shape, 0, shape.size());
        const DType staged_dtype = dtype == DType::BF16 ? DType::F32 : dtype;
        Tensor staged = allocator_->allocate(Context::Workspace, a.name + (dtype == DType::BF16 ? "-float32" : ""),
                                             staged_dtype, {n});
        backend_.copy_from_host(staged, host);
        if (dtype != DType::BF16) return staged;
        Tensor tensor = allocator_->allocate(Context::Workspace, a.name, dtype, {n});
        backend_.copy(tensor, staged);
        return tensor;
    }

    const OpSpec& spec_;
    Backend& backend_;
    const std::string& backend_name_;
    std::map<std::string, const HostArray*> given_;
    std::map<std::string, Bound> ints_;
    std::map<std::string, double> floats_;
    std::map<std::string, bool> bools_;
    std::map<std::string, std::uint64_t> seeds_;
    std::map<std::string, DType> dtypes_;
    std::map<std::string, std::string> aliased_;  // target -> source
    std::map<std::string, std::pair<std::vector<std::int64_t>, std::string>> groups_;  // leading dims, set by
    std::map<std::string, std::vector<std::int64_t>> shapes_;  // of the tensors not given
    std::unique_ptr<NamedAllocator> allocator_;
    std::map<std::string, Tensor> device_;
    std::map<std::string, std::pair<std::vector<float>, Tensor>> uploads_;
    std::map<std::string, std::pair<std::vector<double>, Tensor>> uploads_f64_;
    std::map<std::string, Tensor> workspaces_;
};

const OpSpec& find_op(const std::string& name) {
    for (const OpSpec& op : op_table())
        if (op.name == name) return op;
    std::string names;
    for (const OpSpec& op : op_table()) names += (names.empty() ? "" : ", ") + op.name;
    throw InvalidArgument("unknown op \"" + name + "\"; the ops are: " + names);
}


}  // namespace

std::vector<std::string> stat_slots() {
#define NANOQ_STAT_NAME(id, name) name,
    return {NANOQ_STAT_SLOTS(NANOQ_STAT_NAME)};
#undef NANOQ_STAT_NAME
}

int gather_stride() { return kGatherStride; }

struct OpRunner::Impl {
    std::string name;
    int device = 0;
    std::unique_ptr<Backend> backend;
    std::mutex mutex;  // one op at a time: the backend's scratch is shared
};

OpRunner::OpRunner(const std::string& backend, int device, int threads) : impl_(std::make_unique<Impl>()) {
    const BackendPlugin& plugin = find_backend(backend);
    const int devices = plugin.device_count();
    require(device >= 0 && device < devices, "device " + std::to_string(device) + " of the " + backend +
                                                 " backend asked for, but it has " + std::to_string(devices) +
                                                 " usable device(s)");
    if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    impl_->name = backend;
    impl_->device = device;
    impl_->backend = plugin.create_backend(device, threads);
}

OpRunner::~OpRunner() = default;

const std::string& OpRunner::backend_name() const { return impl_->name; }
int OpRunner::device() const { return impl_->device; }

std::vector<HostResult> OpRunner::run(const std::string& op, const std::vector<HostArray>& tensors,
                                      const Scalars& scalars) {
    BoundCall call(find_op(op), *impl_->backend, impl_->name);
    call.bind(tensors, scalars);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    return call.execute(impl_->device);
}

double OpRunner::time(const std::string& op, const std::vector<HostArray>& tensors, const Scalars& scalars,
                      int repeats) {
    require(repeats >= 1, "repeats must be >= 1, got " + std::to_string(repeats));
    BoundCall call(find_op(op), *impl_->backend, impl_->name);
    call.bind(tensors, scalars);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    double seconds = 0.0;
    call.execute(impl_->device, repeats, &seconds);
    return seconds;
}

}  // namespace nanoq::ops