// Whole training steps on the GPU (issue 4): the CUDA backend's step equals the CPU
// executor's over several steps (FP32, TF32 off), and one step of the `cnn` model equals
// PyTorch's float64 reference (tests/data/golden_cnn.safetensors), in FP32 and under AMP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"

namespace kiln::test {
namespace {

std::vector<float> floats(const StTensor& t) {
  std::vector<float> v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// Largest error relative to the tensor's own largest magnitude.
double scaled_error(const std::vector<float>& got, const std::vector<float>& want, double factor = 1.0) {
  double scale = 1e-12, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) * factor - want[i]));
  }
  return worst / scale;
}

// A batch the network can learn: each class adds a fixed pattern to the noise.
void learnable(const BluePrint& bp, int64_t n, std::vector<float>& img, std::vector<int32_t>& lab) {
  const int64_t per = int64_t{bp.input.height} * bp.input.width * bp.input.channels;
  Rng rng(17);
  std::vector<float> pattern(static_cast<size_t>(bp.num_classes * per));
  for (float& x : pattern) x = static_cast<float>(rng.normal());
  img.resize(static_cast<size_t>(n * per));
  lab.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    lab[static_cast<size_t>(i)] = static_cast<int32_t>(i % bp.num_classes);
    for (int64_t j = 0; j < per; ++j) {
      img[static_cast<size_t>(i * per + j)] =
          pattern[static_cast<size_t>(lab[static_cast<size_t>(i)] * per + j)] + 0.5f * static_cast<float>(rng.normal());
    }
  }
}

// Five steps of resnet18_small on the CUDA backend (FP32, TF32 off, graphs and streams on)
// and on the CPU executor, from the same initial weights: the losses agree within 1e-4
// relative (issue 4). Both sum in different orders, and a training step amplifies
// differences step by step; 1e-4 leaves ~10x room over what FP32 reorderings give here.
TEST(GpuStep, ResNet18SmallFiveStepsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  const BluePrint bp = make_model("resnet18_small");
  std::vector<float> img;
  std::vector<int32_t> lab;
  learnable(bp, 8, img, lab);
  std::vector<std::vector<float>> losses(2);
  int which = 0;
  for (const char* device : {"cpu", "cuda"}) {
    EngineOptions o;
    o.device = device;
    o.compile.batch = 8;
    o.compile.momentum = 0.9f;
    o.compile.weight_decay = 5e-4f;
    Engine e(bp, o);
    e.lock_memory();
    e.compile(21);  // host-side initialisation: identical weights on both backends
    for (int s = 0; s < 5; ++s) losses[static_cast<size_t>(which)].push_back(e.train_step(img.data(), lab.data(), 0.02f).loss);
    ++which;
  }
  for (int s = 0; s < 5; ++s) {
    const double cpu = losses[0][static_cast<size_t>(s)], gpu = losses[1][static_cast<size_t>(s)];
    EXPECT_LT(std::fabs(gpu - cpu) / std::fabs(cpu), 1e-4) << "step " << s << ": cpu " << cpu << " gpu " << gpu;
  }
  EXPECT_LT(losses[1][4], losses[1][0]) << "the loss falls on the GPU";
}

// For the first tensor that disagrees: where its node's tensors live (and any other tensor
// sharing those bytes), and at the worst few elements the node's same-sized inputs on both
// backends, so a stale input (ordering) can be told from a wrong kernel or an overlap.
void explain_mismatch(const Program& p, const Node& n, TensorId bad, std::vector<std::unique_ptr<Engine>>& e) {
  auto fetch = [&](int which, TensorId id) {
    const DTensor& t = e[static_cast<size_t>(which)]->program().tensor(id);
    std::vector<float> v(static_cast<size_t>(t.numel()));
    e[static_cast<size_t>(which)]->backend().read(t, v.data());
    return v;
  };
  std::vector<TensorId> ids = n.in;
  ids.insert(ids.end(), n.out.begin(), n.out.end());
  for (TensorId id : ids) {
    if (id == kNoTensor) continue;
    const DTensor& t = p.tensor(id);
    const DTensor& root = p.storage(id);
    std::printf("    %-34s region %d offset %lld bytes %lld%s\n", t.name.c_str(), static_cast<int>(root.region),
                static_cast<long long>(t.offset), static_cast<long long>(t.bytes()), t.view_of != kNoTensor ? " (view)" : "");
    for (const DTensor& o : p.tensors) {
      if (o.id == id || o.offset < 0 || p.storage(o.id).region != root.region || o.view_of != kNoTensor) continue;
      if (o.offset < t.offset + t.bytes() && t.offset < o.offset + o.bytes() && root.id != o.id) {
        std::printf("      overlaps %s (offset %lld bytes %lld)\n", o.name.c_str(), static_cast<long long>(o.offset),
                    static_cast<long long>(o.bytes()));
      }
    }
  }
  const auto a = fetch(0, bad), b = fetch(1, bad);
  std::vector<size_t> order(a.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + std::min<size_t>(8, order.size()), order.end(),
                    [&](size_t x, size_t y) { return std::fabs(a[x] - b[x]) > std::fabs(a[y] - b[y]); });
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += std::fabs(a[i] - b[i]) > 1e-4 * (std::fabs(a[i]) + 1e-3);
  std::printf("    %zu of %zu elements differ; worst (index: cpu gpu | same-size inputs cpu gpu):\n", differing, a.size());
  for (size_t k = 0; k < std::min<size_t>(8, order.size()); ++k) {
    const size_t i = order[k];
    std::printf("      %zu: %.6g %.6g |", i, a[i], b[i]);
    for (TensorId in : n.in) {
      if (in == kNoTensor || p.tensor(in).numel() != p.tensor(bad).numel() || p.tensor(in).dtype != DType::F32) continue;
      std::printf(" %.6g %.6g", fetch(0, in)[i], fetch(1, in)[i]);
    }
    std::printf("\n");
  }
}

// One step of a model on both backends with memory reuse off (so every tensor keeps its
// last value), then every float tensor a node of the step wrote, compared in program order:
// the first node whose output differs names the kernel that disagrees (a whole-step
// mismatch otherwise says only that something did). FP32, TF32 off: forward outputs within
// 1e-5 of each tensor's scale (as the per-op tests); gradients within 1e-4 (as the golden
// step: they pass through several BN backward reductions that both backends order differently).
void every_tensor_matches(const std::string& model) {
  const BluePrint bp = make_model(model);
  std::vector<float> img;
  std::vector<int32_t> lab;
  learnable(bp, 8, img, lab);
  std::vector<std::unique_ptr<Engine>> engines;
  for (const char* device : {"cpu", "cuda"}) {
    EngineOptions o;
    o.device = device;
    o.compile.batch = 8;
    o.compile.momentum = 0.9f;
    o.compile.weight_decay = 5e-4f;
    o.compile.memory_reuse = false;
    engines.push_back(std::make_unique<Engine>(bp, o));
    engines.back()->lock_memory();
    engines.back()->compile(21);
    engines.back()->train_step(img.data(), lab.data(), 0.02f);
  }
  const Program& p = engines[0]->program();
  std::vector<bool> seen(p.tensors.size(), false);
  int reported = 0;
  bool explained = false;
  for (const Phase& ph : p.train) {
    for (const Node& n : ph.nodes) {
      for (TensorId id : n.out) {
        const DTensor& t = p.tensor(id);
        if (id == kNoTensor || seen[static_cast<size_t>(id)] || t.dtype != DType::F32) continue;
        seen[static_cast<size_t>(id)] = true;
        std::vector<float> a(static_cast<size_t>(t.numel())), b(a.size());
        engines[0]->backend().read(t, a.data());
        engines[1]->backend().read(engines[1]->program().tensor(id), b.data());
        const bool forward = (ph.kind == PhaseKind::forward_first || ph.kind == PhaseKind::forward_backward) &&
                             n.label.find("bwd") == std::string::npos;
        const double err = rel_error(b, a, kSumFloor), tol = forward ? 1e-5 : 1e-4;
        if (err > 1e-6 && reported < 40) {
          ++reported;
          std::printf("  %-18s %-40s %-28s %s  error %.3g of scale\n", ph.name.c_str(), n.label.c_str(),
                      t.name.c_str(), t.shape.str().c_str(), err);
        }
        EXPECT_LT(err, tol) << ph.name << " / " << n.label << " / " << t.name << " " << t.shape.str();
        if (err >= tol && !explained) {
          explained = true;
          explain_mismatch(p, n, id, engines);
        }
      }
    }
  }
}

TEST(GpuStep, EveryTensorOfACnnStepMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  every_tensor_matches("cnn");
}

TEST(GpuStep, EveryTensorOfAResNet18SmallStepMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  every_tensor_matches("resnet18_small");
}

// One step of `cnn` against PyTorch (float64): FP32 to the CPU test's tolerances; AMP within
// SPEC Q2's 1e-2 (FP16 activations and weights carry ~1e-3 relative error per layer).
void golden(bool amp) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/data/golden_cnn.safetensors";
  const StFile g = read_safetensors(path);
  EngineOptions o;
  o.device = "cuda";
  o.compile.batch = 8;
  o.compile.amp = amp;
  o.compile.momentum = 0.9f;
  o.compile.nesterov = true;
  o.compile.weight_decay = 5e-4f;
  Engine e(make_model("cnn"), o);
  e.lock_memory();
  e.compile();
  import_weights(e, path);
  const std::vector<float> images = floats(g.tensors.at("input.nhwc"));
  std::vector<int32_t> labels(8);
  std::memcpy(labels.data(), g.tensors.at("labels").data.data(), 32);
  const StepStats s = e.train_step(images.data(), labels.data(), 0.1f);
  ASSERT_FALSE(s.overflow) << "the first step overflowed at scale " << s.loss_scale;
  const double tol_loss = amp ? 1e-2 : 1e-5, tol_grad = amp ? 1e-2 : 1e-4, tol_w = amp ? 1e-3 : 1e-5;
  const float want_loss = floats(g.tensors.at("loss"))[0];
  EXPECT_NEAR(s.loss, want_loss, tol_loss * std::fabs(want_loss));
  // Gradients in grads_f32 still carry the loss scale (undone inside the optimizer, S8).
  float scale = 1.0f;
  e.backend().read(e.program().tensor(e.program().io.loss_scale), &scale);
  for (const ParamDesc& d : e.program().params) {
    const auto grad = to_torch_layout(d, e.read_param(d.name, Region::grads_f32));
    EXPECT_LT(scaled_error(grad, floats(g.tensors.at("grad." + d.name)), 1.0 / scale), tol_grad) << d.name;
    const auto after = to_torch_layout(d, e.read_param(d.name));
    // The update moves weights by ~1e-2 of their scale: a 1e-2 gradient error is ~1e-4 of it.
    EXPECT_LT(scaled_error(after, floats(g.tensors.at("after." + d.name))), tol_w) << d.name;
  }
}

TEST(GpuStep, CnnStepMatchesPyTorchFp32) {
  KILN_REQUIRE_GPU();
  golden(false);
}

TEST(GpuStep, CnnStepMatchesPyTorchAmp) {
  KILN_REQUIRE_GPU();
  golden(true);
}

}  // namespace
}  // namespace kiln::test
