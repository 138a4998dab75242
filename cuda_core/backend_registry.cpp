// Which backends this install has. The cpu backend is compiled into the core;
// an optional backend (cuda) is a shared library beside the core's
// (libnanoq_<name>.so), loaded the first time it is asked for. Loading it runs
// its static initializer, which calls register_backend(). A CPU-only install
// thus never needs CUDA libraries, and one with the cuda library still runs
// on machines without a driver until the cuda backend is requested.
#include <dlfcn.h>
#include <sys/stat.h>

#include <map>
#include <mutex>
#include <thread>

#include "backend.h"
#include "nanoq/errors.h"

namespace nanoq {

std::unique_ptr<Backend> create_cpu_backend(int device, int threads);
std::vector<ScratchBuffer> cpu_scratch_plan(const ScratchShapes& shapes, int threads, bool ask_libraries);

namespace {

std::recursive_mutex registry_mutex;  // recursive: a loaded library registers while we hold it

std::map<std::string, BackendPlugin>& registry() {
    static std::map<std::string, BackendPlugin> plugins{
        // Classifier chunks of 4M float32 logits (16 MiB): they stay in the caches' neighbourhood.
        {"cpu", BackendPlugin{&create_cpu_backend, &make_shared_memory_group,
                              [] { return static_cast<int>(std::thread::hardware_concurrency()); },
                              &cpu_scratch_plan, std::int64_t(1) << 22,
                              // Its device memory is host memory: batches are staged there directly.
                              MemoryKind::Device, &new_shared_memory_id, /*attention_library=*/nullptr,
                              /*device_memory=*/nullptr}}};
    return plugins;
}

std::string plugin_path(const std::string& name) {
    Dl_info info{};
    if (!dladdr(reinterpret_cast<void*>(&plugin_path), &info) || !info.dli_fname)
        throw NanoqError("cannot locate the nanoq core library to find backend '" + name + "'");
    std::string core = info.dli_fname;
    const auto slash = core.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : core.substr(0, slash);
    return dir + "/libnanoq_" + name + ".so";
}

bool file_exists(const std::string& path) {
    struct stat st {};
    return stat(path.c_str(), &st) == 0;
}

}  // namespace

std::vector<Tensor> allocate_scratch(NamedAllocator& allocator, const std::vector<ScratchBuffer>& plan) {
    std::vector<Tensor> tensors;
    for (const ScratchBuffer& b : plan)
        tensors.push_back(allocator.allocate(Context::Workspace, b.name, b.dtype, {b.elements}, b.kind, b.exact));
    return tensors;
}

void register_backend(const std::string& name, const BackendPlugin& plugin) {
    std::lock_guard<std::recursive_mutex> lock(registry_mutex);
    registry()[name] = plugin;
}

bool backend_built(const std::string& name) {
    {
        std::lock_guard<std::recursive_mutex> lock(registry_mutex);
        if (registry().count(name)) return true;
    }
    return name.find('/') == std::string::npos && file_exists(plugin_path(name));
}

const BackendPlugin& find_backend(const std::string& name) {
    std::lock_guard<std::recursive_mutex> lock(registry_mutex);
    auto it = registry().find(name);
    if (it != registry().end()) return it->second;
    if (!backend_built(name))
        throw InvalidArgument("backend '" + name + "' is not built into this install of nanoq" +
                              (name == "cuda" ? " (build it with NANOQ_CUDA=ON)" : ""));
    const std::string path = plugin_path(name);
    // The library stays loaded for the life of the process, like its code.
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL))
        throw NanoqError("cannot load the " + name + " backend (" + path + "): " + dlerror());
    it = registry().find(name);
    if (it == registry().end()) throw NanoqError(path + " loaded but did not register backend '" + name + "'");
    return it->second;
}

}  // namespace nanoq
