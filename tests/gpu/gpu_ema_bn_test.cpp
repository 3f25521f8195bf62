// The EMA model's BatchNorm statistics on the CUDA backend (issue 18): after a few steps they
// equal a float64 replay of the EMA recurrence over the live statistics (FP32, and AMP, whose
// overflowed steps the device and the replay both skip), and the EMA evaluation uses them.
// The CPU counterpart is e2e/ema_bn_test.cpp.
#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "kiln/task/checkpoint.h"
#include "support/ema_bn_check.h"
#include "support/learnable_batch.h"

namespace kiln::test {
namespace {

TEST(GpuEmaBn, RecurrenceMatchesFloat64Reference) {
  KILN_REQUIRE_GPU();
  check_ema_bn_recurrence("cuda", false, "cnn", 0.9f, 6);
  check_ema_bn_recurrence("cuda", false, "resnet18_small", 0.5f, 4);
}

TEST(GpuEmaBn, RecurrenceMatchesFloat64ReferenceAmp) {
  KILN_REQUIRE_GPU();
  check_ema_bn_recurrence("cuda", true, "resnet18_small", 0.5f, 4);
}

// The CUDA engine's EMA evaluation against a CUDA engine without EMA holding the EMA weights
// and the EMA statistics (FP32: the same kernels over the same values), and against one with
// the live statistics instead, which must differ.
TEST(GpuEmaBn, EmaEvaluationUsesTheEmaStatistics) {
  KILN_REQUIRE_GPU();
  const BluePrint bp = make_model("cnn");
  EngineOptions o;
  o.device = "cuda";
  o.compile.batch = 8;
  o.compile.ema = true;
  o.compile.ema_decay = 0.5f;
  Engine a(bp, o);
  a.lock_memory();
  a.compile(7);
  for (int s = 0; s < 5; ++s) {
    const LearnableBatch b = learnable_batch(bp, 8, 40 + static_cast<uint64_t>(s));
    a.train_step(b.images.data(), b.labels.data(), 0.05f);
  }
  const LearnableBatch probe = learnable_batch(bp, 8, 999);
  const float ema = a.eval_batch(probe.images.data(), probe.labels.data(), 8, true).loss;
  auto plain = [&](const StFile& sd) {
    EngineOptions po = o;
    po.compile.ema = false;
    Engine b(bp, po);
    b.lock_memory();
    b.compile(1);
    import_state_dict(b, sd, "test");
    return b.eval_batch(probe.images.data(), probe.labels.data(), 8, false).loss;
  };
  const StFile ema_sd = export_state_dict(a, true);
  // Engine selection may differ between two compiles: FP32 tolerance of the loss (SPEC Q2).
  EXPECT_NEAR(plain(ema_sd), ema, kGpuFp32Tol * (1.0 + std::fabs(ema)));
  StFile live_stats = ema_sd;
  const StFile live_sd = export_state_dict(a, false);
  for (const BufferDesc& buf : a.program().buffers)
    live_stats.tensors[buf.name] = live_sd.tensors.at(buf.name);
  EXPECT_GT(std::fabs(plain(live_stats) - ema), 1e-3)
      << "the EMA's own statistics made no difference";
}

}  // namespace
}  // namespace kiln::test
