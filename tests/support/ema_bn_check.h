// The EMA of the BatchNorm running statistics against a float64 reference of its recurrence,
// one copy for the CPU test (e2e/ema_bn_test.cpp) and the CUDA one (gpu/gpu_ema_bn_test.cpp):
// a few steps with EMA on, the live buffers read after each, and e = d e + (1 - d) live
// replayed in float64 from the start (the live buffers at compile), skipping overflowed steps
// as the device does.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"

namespace kiln::test {

// Tolerance: the device runs the same recurrence in FP32, each step rounding d*e and (1-d)*x
// and their sum (3 roundings of 2^-24 relative); over `steps` steps the error stays below
// 4 * steps * 2^-24 of the largest magnitude met, far under 1e-5 for the few steps here.
inline double ema_bn_tolerance(int steps, double magnitude) {
  return 4.0 * steps * std::ldexp(1.0, -24) * (magnitude + 1.0);
}

inline void check_ema_bn_recurrence(const std::string& device, bool amp, const std::string& model,
                                    float decay, int steps) {
  const BluePrint bp = make_model(model);
  EngineOptions o;
  o.device = device;
  o.compile.batch = 8;
  o.compile.amp = amp;
  o.compile.ema = true;
  o.compile.ema_decay = decay;
  Engine e(bp, o);
  e.lock_memory();
  e.compile(3);
  const Program& p = e.program();
  ASSERT_FALSE(p.buffers.empty()) << model << " has no BatchNorm";
  std::map<std::string, std::vector<double>> want;
  for (const BufferDesc& b : p.buffers) {
    const std::vector<float> live = e.read_param(b.name);
    want[b.name].assign(live.begin(), live.end());
    EXPECT_EQ(e.read_param(b.name, Region::ema_bn_running), live)
        << b.name << " starts at the live value";
  }
  double magnitude = 0;
  for (int s = 0; s < steps; ++s) {
    // A new batch each step, so that the running statistics move.
    const LearnableBatch batch = learnable_batch(bp, 8, 100 + static_cast<uint64_t>(s));
    const StepStats st = e.train_step(batch.images.data(), batch.labels.data(), 0.05f);
    if (st.overflow) continue;
    for (const BufferDesc& b : p.buffers) {
      const std::vector<float> live = e.read_param(b.name);
      std::vector<double>& w = want[b.name];
      for (size_t i = 0; i < w.size(); ++i) {
        w[i] = decay * w[i] + (1.0 - static_cast<double>(decay)) * live[i];
        magnitude = std::max(magnitude, std::fabs(w[i]));
      }
    }
  }
  const double tol = ema_bn_tolerance(steps, magnitude);
  bool moved = false;
  for (const BufferDesc& b : p.buffers) {
    const std::vector<float> got = e.read_param(b.name, Region::ema_bn_running);
    const std::vector<float> live = e.read_param(b.name);
    const std::vector<double>& w = want.at(b.name);
    ASSERT_EQ(got.size(), w.size()) << b.name;
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(got[i], w[i], tol) << b.name << "[" << i << "] after " << steps << " steps";
      if (std::fabs(got[i] - live[i]) > 1e-3) moved = true;
    }
  }
  EXPECT_TRUE(moved)
      << "the EMA statistics equal the live ones: the test would not tell them apart";
}

}  // namespace kiln::test
