// A small deterministic random number generator (SplitMix64) with uniform and
// normal draws whose results are identical on every platform and standard
// library (std::normal_distribution is not), so the same seed gives bitwise
// the same parameters and batches everywhere.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace mt {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  // A seed derived from a base seed and a name (e.g. a parameter's name), so
  // each stream is independent of the order in which streams are created.
  static uint64_t derive(uint64_t seed, std::string_view name) {
    uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the name
    for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return h;
  }

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal by Box-Muller (uses two uniforms per draw; no caching, so
  // the stream position is simple to reason about).
  double normal() {
    double u1 = uniform();
    double u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace mt
