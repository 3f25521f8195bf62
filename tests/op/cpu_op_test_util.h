// Helpers for the CPU op tests (tests/op/cpu_*_test.cpp): random inputs, the CPU backend,
// and gtest assertions that print the error and the bound.
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "support/op_harness.h"
#include "support/reference.h"

namespace kiln::test {

// The FP32 bar of SPEC Q2: 1e-5, applied to the error divided by the magnitude the rounding
// error scales with (see ref::max_scaled_error). For a sum of n products computed in FP32 the
// bound is gamma_n = n 2^-24 worst case and ~sqrt(n) 2^-24 typically; the largest sums here
// have n <= ~1000 terms (sqrt(n) 2^-24 <= 2e-6), so 1e-5 is the SPEC's number with headroom.
inline constexpr double kFp32Tol = 1e-5;

inline std::vector<float> rand_vec(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  return random_values(static_cast<size_t>(n), seed, lo, hi);
}
inline std::vector<int32_t> rand_labels(int64_t n, int64_t classes, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(classes)));
  return v;
}

inline void compile_cpu(OpHarness& h) {
  h.compile(make_backend("cpu"));
}

// print_op_errors(): every measured error beside its bound.
inline void expect_error_within(double err, double tol, const std::string& what) {
  if (print_op_errors()) std::printf("  %-44s error %9.3g  bound %9.3g\n", what.c_str(), err, tol);
  EXPECT_LE(err, tol) << what << ": error " << err << " exceeds " << tol;
}

// EXPECT that got matches want within tol * mag elementwise.
#define KILN_EXPECT_SCALED(got, want, mag, tol, what)                                           \
  ::kiln::test::expect_error_within(::kiln::ref::max_scaled_error((got), (want), (mag)), (tol), \
                                    (what))
// EXPECT a relative error within tol (absolute below `floor`).
#define KILN_EXPECT_REL(got, want, floor, tol, what)                                           \
  ::kiln::test::expect_error_within(::kiln::ref::max_rel_error((got), (want), (floor)), (tol), \
                                    (what))

}  // namespace kiln::test
