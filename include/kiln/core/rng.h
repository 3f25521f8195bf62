// Rng: a small, fast, seedable generator (xoshiro256**) whose whole state can be saved
// in a checkpoint and restored, so that a resumed run draws the same numbers.
#pragma once
#include <array>
#include <cstdint>

namespace kiln {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { seed_with(seed); }
  void seed_with(uint64_t seed);
  // Independent stream for (seed, a, b): e.g. (run seed, epoch, worker).
  static Rng derive(uint64_t seed, uint64_t a, uint64_t b = 0);

  uint64_t next_u64();
  uint32_t next_u32() { return static_cast<uint32_t>(next_u64() >> 32); }
  double uniform();                   // [0, 1)
  float uniform(float lo, float hi);  // [lo, hi)
  uint64_t below(uint64_t n);         // [0, n), unbiased
  double normal();                    // mean 0, std 1 (Box-Muller)
  double gamma(double shape);         // Gamma(shape, 1), shape > 0 (Marsaglia-Tsang)
  double beta(double a, double b);    // Beta(a, b) = Ga / (Ga + Gb), a, b > 0

  std::array<uint64_t, 4> state() const { return s_; }
  void set_state(const std::array<uint64_t, 4>& s) { s_ = s; }

 private:
  std::array<uint64_t, 4> s_{};
};

uint64_t splitmix64(uint64_t& x);

}  // namespace kiln
