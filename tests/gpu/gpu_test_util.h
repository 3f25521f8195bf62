// Helpers for the GPU tests: the same hand-built Program compiled on the CPU backend (the
// reference, FP32) and on the CUDA backend (FP32, or FP16 features under AMP), fed the same
// inputs, and compared. Every test skips cleanly (GTEST_SKIP) where no GPU is present.
//
// Tolerances (SPEC Q2, issue 4): FP32 within 1e-5, AMP within 1e-2, of the error measure
// `rel_error` below. For ops whose outputs are sums of products (convolution, fc, BN, pooling
// sums) the error is taken relative to the tensor's largest magnitude: such a sum rounds
// with the size of its terms, not of its (possibly cancelling) result, and the two backends
// sum in different orders. Elementwise ops compare relative to each element (floor 1e-3 of
// the largest magnitude, so exact zeros do not divide).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kiln/backend/backend.h"
#include "kiln/core/dtype.h"
#include "kiln/core/rng.h"
#include "support/op_harness.h"

namespace kiln::test {

#define KILN_REQUIRE_GPU()                                                        \
  do {                                                                            \
    if (!::kiln::cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine"; \
  } while (0)

inline constexpr double kGpuFp32Tol = 1e-5;  // SPEC Q2, FP32 with TF32 off
inline constexpr double kGpuAmpTol = 1e-2;   // SPEC Q2, FP16 features
inline constexpr double kSumFloor = 1.0;     // relative to max |want| (sums of products)
inline constexpr double kEltFloor = 1e-3;    // elementwise

// max_i |got_i - want_i| / max(|want_i|, floor * max_j |want_j|); NaN anywhere = infinity.
inline double rel_error(const std::vector<float>& got, const std::vector<float>& want,
                        double floor) {
  if (got.size() != want.size()) return INFINITY;
  double mx = 0.0;
  for (float w : want) mx = std::max(mx, std::fabs(static_cast<double>(w)));
  const double f = std::max(floor * mx, 1e-30);
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) /
                     std::max(std::fabs(static_cast<double>(want[i])), f);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst;
}

inline std::vector<float> rand_floats(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}
inline std::vector<float> round_f16(std::vector<float> v) {
  for (auto& x : v) x = half_to_float(float_to_half(x));
  return v;
}
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// Distance in units in the last place between two floats of the same sign (NaN: huge).
inline int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return (std::isnan(a) && std::isnan(b)) ? 0 : INT64_MAX;
  auto key = [](float f) {
    const auto u = static_cast<int64_t>(bits_of(f));
    return u & 0x80000000 ? -(u & 0x7fffffff) : u;
  };
  return std::llabs(key(a) - key(b));
}
inline int64_t max_ulp(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INT64_MAX;
  int64_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, ulp_distance(a[i], b[i]));
  return worst;
}

// What a tensor is, so that the pair can give it the right dtype on each side.
enum class Kind {
  Feature,     // features region: f32 on the CPU, f16 on the GPU under AMP
  Weight,      // a conv / fc weight: params_f32 on the CPU, params_f16 (f16) under AMP
  WeightGrad,  // a conv weight gradient: grads_f32 on the CPU, grads_f16 (f16) under AMP
  F32,         // f32 in the given region on both
  I32,
  U8,
};

// One Program built twice: on the CPU backend (FP32) and on the CUDA backend (AMP or not).
class Pair {
 public:
  // `switches`: the CUDA backend's (tests set fields, e.g. vector_kernels, pad_channels).
  explicit Pair(bool amp, Switches switches = Switches::from_environment())
      : amp_(amp), switches_(std::move(switches)), cpu_(false), gpu_(amp) {}

  TensorId add(const std::string& name, Shape shape, Kind kind, Region region = Region::features) {
    DType gd = DType::F32, cd = DType::F32;
    Region gr = region, cr = region;
    Layout layout = shape.rank() == 4 ? Layout::NHWC : Layout::Flat;
    switch (kind) {
      case Kind::Feature:
        gd = amp_ ? DType::F16 : DType::F32;
        gr = cr = Region::features;
        break;
      case Kind::Weight:
        cr = Region::params_f32;
        gr = amp_ ? Region::params_f16 : Region::params_f32;
        gd = amp_ ? DType::F16 : DType::F32;
        layout = shape.rank() == 4 ? Layout::KRSC : Layout::OI;
        break;
      case Kind::WeightGrad:
        cr = Region::grads_f32;
        gr = amp_ ? Region::grads_f16 : Region::grads_f32;
        gd = amp_ ? DType::F16 : DType::F32;
        layout = shape.rank() == 4 ? Layout::KRSC : Layout::OI;
        break;
      case Kind::F32:
        break;
      case Kind::I32:
        gd = cd = DType::I32;
        if (gr == Region::features) gr = cr = Region::aux;
        break;
      case Kind::U8:
        gd = cd = DType::U8;
        if (gr == Region::features) gr = cr = Region::aux;
        break;
    }
    const TensorId a = cpu_.tensor(name, shape, cr, cd, layout);
    const TensorId b = gpu_.tensor(name, shape, gr, gd, layout);
    EXPECT_EQ(a, b);
    return a;
  }
  void node(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, Attrs a = {}) {
    cpu_.node(op, in, out, a);
    gpu_.node(op, in, out, a);
  }
  void compile() {
    cpu_.compile(make_backend("cpu"));
    gpu_.compile(make_backend("cuda", switches_));
  }
  // Writes the same values to both (rounded to f16 first where the GPU tensor is f16).
  std::vector<float> set(TensorId id, std::vector<float> v) {
    if (gpu_.program().tensor(id).dtype == DType::F16) v = round_f16(std::move(v));
    cpu_.write(id, v);
    gpu_.write(id, v);
    return v;
  }
  std::vector<float> set_random(TensorId id, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    return set(id, rand_floats(gpu_.program().tensor(id).numel(), seed, lo, hi));
  }
  void set_i32(TensorId id, const std::vector<int32_t>& v) {
    cpu_.write_i32(id, v);
    gpu_.write_i32(id, v);
  }
  void run() {
    cpu_.run();
    gpu_.run();
  }
  double error(TensorId id, double floor) { return rel_error(gpu_.read(id), cpu_.read(id), floor); }
  double tol() const { return amp_ ? kGpuAmpTol : kGpuFp32Tol; }

  OpHarness& cpu() { return cpu_; }
  OpHarness& gpu() { return gpu_; }
  bool amp() const { return amp_; }

 private:
  bool amp_;
  Switches switches_;
  OpHarness cpu_, gpu_;
};

#define KILN_EXPECT_CLOSE(pair, id, floor, what)                                            \
  do {                                                                                      \
    const double kiln_err_ = (pair).error((id), (floor));                                   \
    EXPECT_LE(kiln_err_, (pair).tol()) << (what) << (pair.amp() ? " (AMP)" : " (FP32)")     \
                                       << ": error " << kiln_err_ << " > " << (pair).tol(); \
  } while (0)

}  // namespace kiln::test
