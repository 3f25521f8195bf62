#include "kiln/core/rng.h"

#include <cmath>

namespace kiln {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void Rng::seed_with(uint64_t seed) {
  uint64_t x = seed;
  for (auto& w : s_) w = splitmix64(x);
}

Rng Rng::derive(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t x = seed;
  uint64_t h = splitmix64(x) ^ (a * 0xd1342543de82ef95ull);
  h = splitmix64(h) ^ (b * 0xaf251af3b0f025b5ull);
  return Rng(splitmix64(h));
}

static inline uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() {
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

float Rng::uniform(float lo, float hi) {
  return lo + static_cast<float>(uniform()) * (hi - lo);
}

uint64_t Rng::below(uint64_t n) {
  if (n <= 1) return 0;
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t r;
  do {
    r = next_u64();
  } while (r >= limit);
  return r % n;
}

double Rng::normal() {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Marsaglia and Tsang (2000), with their boost for shape < 1: Gamma(a) = Gamma(a + 1) U^(1/a).
double Rng::gamma(double shape) {
  if (shape < 1.0) {
    double u = uniform();
    while (u <= 0.0) u = uniform();
    return gamma(shape + 1.0) * std::pow(u, 1.0 / shape);
  }
  const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    const double x = normal();
    double v = 1.0 + c * x;
    if (v <= 0.0) continue;
    v = v * v * v;
    const double u = uniform();
    if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
    if (u > 0.0 && std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
  }
}

double Rng::beta(double a, double b) {
  const double ga = gamma(a), gb = gamma(b);
  // Both can underflow to 0 for a tiny shape; the distribution is then all at the ends.
  if (ga + gb <= 0.0) return uniform() < a / (a + b) ? 1.0 : 0.0;
  return ga / (ga + gb);
}

}  // namespace kiln
