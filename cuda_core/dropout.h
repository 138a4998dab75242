// The dropout mask, as a pure function of (seed, element index).
//
// A counter-based hash (the splitmix64 finaliser) decides each element, so a
// mask takes no memory: backward and recomputation regenerate exactly the
// mask of the forward pass, and the cpu and cuda backends draw the same one.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define NANOQ_HOST_DEVICE __host__ __device__
#else
#define NANOQ_HOST_DEVICE
#endif

namespace nanoq {

NANOQ_HOST_DEVICE inline std::uint64_t splitmix64(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Whether element `index` survives dropout with probability `drop` of
// being zeroed: a uniform 24-bit draw u in [0, 1) is kept when u >= drop.
NANOQ_HOST_DEVICE inline bool dropout_keep(std::uint64_t seed, std::uint64_t index, float drop) {
    const std::uint64_t z = splitmix64(seed + (index + 1) * 0x9E3779B97F4A7C15ULL);
    return static_cast<float>(z >> 40) * (1.0f / 16777216.0f) >= drop;
}

// A seed for each of several streams drawn from one seed (e.g. one per
// layer and projection).
NANOQ_HOST_DEVICE inline std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream) {
    return splitmix64(seed ^ (stream * 0xD1B54A32D192ED03ULL + 0x632BE59BD9B4E019ULL));
}

// The seed of a mask (Backend::scale_dropout): `seed` itself, or stream
// `seed` of the seed at `base` (device memory: a value that changes between
// replays of a CUDA graph without changing its kernel arguments).
NANOQ_HOST_DEVICE inline std::uint64_t dropout_mask_seed(std::uint64_t seed, const std::uint64_t* base) {
    return base ? mix_seed(*base, seed) : seed;
}

}  // namespace nanoq
