// CUB's DeviceRadixSort::SortPairs for the CPU emulator: a stable sort of
// (key, value) pairs by the key bits [begin_bit, end_bit), queued on the
// stream. Keys are ordered as CUB orders them (signed keys with the sign bit
// flipped). It asks for temporary storage as CUB does (a size query with a
// null pointer first) and checks that it got enough.
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../../cuda_runtime.h"

namespace cub {

struct DeviceRadixSort {
    template <class Key, class Value>
    static std::size_t TempBytes(int num_items) {
        // Room for a double buffer of pairs and the digit histograms, as a
        // one-sweep radix sort needs; the exact figure is the emulator's.
        return static_cast<std::size_t>(num_items > 0 ? num_items : 0) * (sizeof(Key) + sizeof(Value)) + 4096;
    }

    template <class Key, class Value>
    static cudaError_t SortPairs(void* d_temp_storage, std::size_t& temp_storage_bytes, const Key* d_keys_in,
                                 Key* d_keys_out, const Value* d_values_in, Value* d_values_out, int num_items,
                                 int begin_bit = 0, int end_bit = sizeof(Key) * 8, cudaStream_t stream = nullptr) {
        static_assert(std::is_integral<Key>::value, "the emulator sorts integer keys");
        const std::size_t needed = TempBytes<Key, Value>(num_items);
        if (d_temp_storage == nullptr) {
            temp_storage_bytes = needed;
            return cudaSuccess;
        }
        if (temp_storage_bytes < needed || begin_bit < 0 || end_bit > static_cast<int>(sizeof(Key) * 8) ||
            begin_bit > end_bit)
            return cudaErrorInvalidValue;
        ::nanoq_emu::enqueue(
            stream,
            [=] {
                using Bits = std::make_unsigned_t<Key>;
                const Bits flip = std::is_signed<Key>::value ? Bits(Bits(1) << (sizeof(Key) * 8 - 1)) : Bits(0);
                const int width = end_bit - begin_bit;
                const Bits mask = width >= static_cast<int>(sizeof(Key) * 8) ? Bits(~Bits(0))
                                                                            : Bits((Bits(1) << width) - 1);
                auto digit = [&](Key k) { return Bits((Bits(static_cast<Bits>(k) ^ flip) >> begin_bit) & mask); };
                std::vector<int> order(num_items);
                std::iota(order.begin(), order.end(), 0);
                std::stable_sort(order.begin(), order.end(),
                                 [&](int a, int b) { return digit(d_keys_in[a]) < digit(d_keys_in[b]); });
                std::vector<Key> keys(num_items);
                std::vector<Value> values(num_items);
                for (int i = 0; i < num_items; ++i) {
                    keys[i] = d_keys_in[order[i]];
                    values[i] = d_values_in[order[i]];
                }
                std::copy(keys.begin(), keys.end(), d_keys_out);
                std::copy(values.begin(), values.end(), d_values_out);
            },
            "cub::DeviceRadixSort::SortPairs");
        return cudaSuccess;
    }
};

}  // namespace cub
