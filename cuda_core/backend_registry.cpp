// Which backends this build has. The cpu backend is always compiled in; an
// optional backend library calls register_backend() from a static initializer.
#include <map>
#include <mutex>

#include "backend.h"
#include "nanoq/errors.h"

namespace nanoq {

std::unique_ptr<Backend> create_cpu_backend(int device, int threads);

namespace {
std::mutex registry_mutex;
std::map<std::string, BackendFactory>& registry() {
    static std::map<std::string, BackendFactory> factories{{"cpu", &create_cpu_backend}};
    return factories;
}
}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry()[name] = factory;
}

bool backend_available(const std::string& name) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    return registry().count(name) > 0;
}

std::unique_ptr<Backend> create_backend(const std::string& name, int device, int threads) {
    BackendFactory factory;
    {
        std::lock_guard<std::mutex> lock(registry_mutex);
        auto it = registry().find(name);
        if (it == registry().end()) throw InvalidArgument("backend '" + name + "' is not available in this build");
        factory = it->second;
    }
    return factory(device, threads);
}

}  // namespace nanoq
