// Testing hooks: the one door through which tests make the trainer do what
// a healthy run never does (fail inside a worker, ...), so that the failure
// paths can be tested. Product code never arms a hook; a disarmed hook costs
// one atomic load where the trainer consults it.
//
// A hook is a named integer slot: armed with a value by a test (Python:
// nanoq.testing), read or taken (read and disarmed) by the trainer.
// Adding a hook is one line in NANOQ_TESTING_HOOKS below, plus the place in
// the trainer that consults it; the binding and nanoq.testing find it by name.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "nanoq/errors.h"

// X(enumerator, name, disarmed value, what an armed value does)
#define NANOQ_TESTING_HOOKS(X)                                                                  \
    X(kFailNextStepInWorker, "fail_next_step_in_worker", -1,                                    \
      "the next step() throws NanoqError inside worker <value>, as a failing device would")    \
    X(kDelayNextStepInWorker, "delay_next_step_in_worker", -1,                                  \
      "the next step()'s work on worker <value> starts delay_next_step_milliseconds late "      \
      "(step() itself returns without waiting), as a slow device would")                        \
    X(kDelayNextStepMilliseconds, "delay_next_step_milliseconds", 0,                            \
      "how late delay_next_step_in_worker (and delay_next_validate_in_worker) starts that work") \
    X(kDelayNextValidateInWorker, "delay_next_validate_in_worker", -1,                          \
      "the next validate()'s work on worker <value> starts delay_next_step_milliseconds late, "  \
      "as a slow device would")                                                                 \
    X(kSynchronousReductions, "synchronous_gradient_reductions", 0,                             \
      "nonzero: step() runs gradient reductions synchronously, as before they overlapped the "   \
      "backward (ZeRO stage 1: all in update())")                                               \
    X(kTraceCommunication, "trace_communication", 0,                                            \
      "nonzero: each step() records, per device, the order of the layers' backward and the "    \
      "gradient reductions (Trainer::communication_trace)")                                      \
    X(kRefuseKvCacheInWorker, "refuse_kv_cache_in_worker", -1,                                  \
      "the next KV-cache allocation (generation's first call) on worker <value> is refused as "  \
      "out of memory after it allocated, as a device short of memory part way would")

namespace nanoq {

enum class TestingHook : int {
#define NANOQ_TESTING_HOOK_ENUMERATOR(id, name, disarmed, doc) id,
    NANOQ_TESTING_HOOKS(NANOQ_TESTING_HOOK_ENUMERATOR)
#undef NANOQ_TESTING_HOOK_ENUMERATOR
};

struct TestingHookInfo {
    std::string name;
    std::int64_t disarmed;
    std::string doc;
};

class TestingHooks {
public:
    TestingHooks() {
        for (std::size_t i = 0; i < kCount; ++i) values_[i] = info()[i].disarmed;
    }

    // Every hook, in enumerator order.
    static const std::vector<TestingHookInfo>& info() {
        static const std::vector<TestingHookInfo> hooks = {
#define NANOQ_TESTING_HOOK_INFO(id, name, disarmed, doc) {name, disarmed, doc},
            NANOQ_TESTING_HOOKS(NANOQ_TESTING_HOOK_INFO)
#undef NANOQ_TESTING_HOOK_INFO
        };
        return hooks;
    }

    // Arms hook `name` with `value`; InvalidArgument for an unknown name.
    void arm(const std::string& name, std::int64_t value) { values_[index(name)] = value; }
    // The hook's value, left armed.
    std::int64_t get(TestingHook hook) const { return values_[static_cast<int>(hook)]; }
    // The hook's value; the hook is disarmed.
    std::int64_t take(TestingHook hook) {
        return values_[static_cast<int>(hook)].exchange(info()[static_cast<int>(hook)].disarmed);
    }

private:
#define NANOQ_TESTING_HOOK_COUNT(id, name, disarmed, doc) +1
    static constexpr std::size_t kCount = 0 NANOQ_TESTING_HOOKS(NANOQ_TESTING_HOOK_COUNT);
#undef NANOQ_TESTING_HOOK_COUNT

    static std::size_t index(const std::string& name) {
        std::string names;
        for (std::size_t i = 0; i < kCount; ++i) {
            if (info()[i].name == name) return i;
            names += (i ? ", " : "") + info()[i].name;
        }
        throw InvalidArgument("unknown testing hook \"" + name + "\"; the hooks are: " + names);
    }

    std::atomic<std::int64_t> values_[kCount];
};

}  // namespace nanoq
