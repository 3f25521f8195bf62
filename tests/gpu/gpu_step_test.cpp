// Whole training steps on the GPU (issue 4): the CUDA backend's step equals the CPU
// executor's over several steps (FP32, TF32 off), and one step of the `cnn` model equals
// PyTorch's float64 reference (tests/data/golden_cnn.safetensors), in FP32 and under AMP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"
#include "support/async_stats_check.h"
#include "support/learnable_batch.h"

namespace kiln::test {
namespace {

std::vector<float> floats(const StTensor& t) {
  std::vector<float> v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// Largest error relative to the tensor's own largest magnitude.
double scaled_error(const std::vector<float>& got, const std::vector<float>& want,
                    double factor = 1.0) {
  double scale = 1e-12, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) * factor - want[i]));
  }
  return worst / scale;
}

// The batch the GPU figures in bench/RESULTS.md were measured on (seed 17).
void learnable(const BluePrint& bp, int64_t n, std::vector<float>& img, std::vector<int32_t>& lab) {
  LearnableBatch b = learnable_batch(bp, n, 17);
  img = std::move(b.images);
  lab = std::move(b.labels);
}

// Five steps of resnet18_small on the CUDA backend (FP32, TF32 off, graphs and streams on)
// and on the CPU executor, from the same initial weights and batch. Step 0's loss is a pure
// forward pass (continuous in every input): within 1e-5, as the per-op tests. Later steps
// start from weights updated with gradients that can differ by a ReLU mask flip (see
// every_tensor_matches below: one element of ~10^5 whose input both backends round to either
// side of zero; measured on the H200, 1-2 per step of this model), and the next step's BN
// statistics over 8 samples amplify such differences: measured 3e-4 at step 2 and 4.3e-3 at
// step 4 with every kernel agreeing to 1e-5 on agreeing inputs. So steps 1-4 are held to
// 1e-2, and the exact equivalence of the multi-step machinery (momentum, running statistics,
// A/B staging, graph replay) is asserted bit for bit by OptimisationsOnEqualOffBitForBit.
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
    for (int s = 0; s < 5; ++s)
      losses[static_cast<size_t>(which)].push_back(
          e.train_step(img.data(), lab.data(), 0.02f).loss);
    ++which;
  }
  for (int s = 0; s < 5; ++s) {
    const double cpu = losses[0][static_cast<size_t>(s)], gpu = losses[1][static_cast<size_t>(s)];
    std::printf("  step %d: cpu %.8f gpu %.8f relative difference %.3g\n", s, cpu, gpu,
                std::fabs(gpu - cpu) / cpu);
    EXPECT_LT(std::fabs(gpu - cpu) / std::fabs(cpu), s == 0 ? 1e-5 : 1e-2) << "step " << s;
  }
  EXPECT_LT(losses[1][4], 0.5 * losses[1][0]) << "the loss falls on the GPU";
}

// Six training steps of `model` at batch 8 with every optimisation of the CUDA executor on
// (CUDA graphs replayed from the second step, three streams, weight gradients on the side
// stream as KILN_SIDE_WGRAD says, memory reuse) or all of them off (node-by-node launches,
// one stream, every tensor in its own bytes): the losses, weights, momenta and BN running
// statistics. Deterministic cuDNN engines (KILN_DETERMINISTIC=1) make runs comparable bit for
// bit: only launch order, streams and addresses differ, so any difference is a race, a
// missing join or two live tensors sharing bytes.
struct StepsRun {
  std::vector<float> losses, params, moments, running;
  int side_wgrads = -1;  // weight gradients forked to the side stream
};

StepsRun six_steps(const std::string& model, bool amp, bool optimised, const char* side_wgrad) {
  const BluePrint bp = make_model(model);
  std::vector<float> img;
  std::vector<int32_t> lab;
  learnable(bp, 8, img, lab);
  EngineOptions o;
  o.switches.deterministic = true;
  o.switches.cuda_graphs = optimised;
  o.switches.streams = optimised ? 3 : 1;
  o.switches.set("side_wgrad", side_wgrad, "KILN_SIDE_WGRAD");
  o.device = "cuda";
  o.compile.batch = 8;
  o.compile.amp = amp;
  o.compile.momentum = 0.9f;
  o.compile.weight_decay = 5e-4f;
  o.switches.memory_reuse = optimised;
  Engine e(bp, o);
  e.lock_memory();
  e.compile(21);
  StepsRun r;
  if (auto* api = dynamic_cast<CudaBackendApi*>(&e.backend()))
    r.side_wgrads = api->side_stream_wgrads();
  for (int s = 0; s < 6; ++s) r.losses.push_back(e.train_step(img.data(), lab.data(), 0.02f).loss);
  for (const ParamDesc& d : e.program().params) {
    for (Region reg : {Region::params_f32, Region::moment1}) {
      const auto v = e.read_param(d.name, reg);
      auto& dst = reg == Region::params_f32 ? r.params : r.moments;
      dst.insert(dst.end(), v.begin(), v.end());
    }
  }
  for (const BufferDesc& b : e.program().buffers) {
    const DTensor& t = e.program().tensor(b.tensor);
    if (t.dtype != DType::F32) continue;
    std::vector<float> v(static_cast<size_t>(t.numel()));
    e.backend().read(t, v.data());
    r.running.insert(r.running.end(), v.begin(), v.end());
  }
  return r;
}

void expect_same_bits(const StepsRun& a, const StepsRun& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_EQ(bits_of(a.losses[s]), bits_of(b.losses[s]))
        << "step " << s << ": " << a.losses[s] << " vs " << b.losses[s];
  }
  EXPECT_EQ(max_ulp(a.params, b.params), 0) << "weights";
  EXPECT_EQ(max_ulp(a.moments, b.moments), 0) << "momentum buffers";
  EXPECT_EQ(max_ulp(a.running, b.running), 0) << "BN running statistics";
  EXPECT_FALSE(a.running.empty());
}

TEST(GpuStep, OptimisationsOnEqualOffBitForBitFp32) {
  KILN_REQUIRE_GPU();
  expect_same_bits(six_steps("resnet18_small", false, true, "1"),
                   six_steps("resnet18_small", false, false, "1"));
}

TEST(GpuStep, OptimisationsOnEqualOffBitForBitAmp) {
  KILN_REQUIRE_GPU();
  expect_same_bits(six_steps("resnet18_small", true, true, "1"),
                   six_steps("resnet18_small", true, false, "1"));
}

// Weight gradients on the side stream (side_stream.h) against on their node's stream, every
// other optimisation on: the same bits, FP32 and AMP (fused CBR backward under AMP and in FP32
// on CUDA, plain convolution backward for the layers before BN+add+ReLU), a ResNet and a VGG.
TEST(GpuStep, SideStreamWeightGradientsOffAndOnBitForBit) {
  KILN_REQUIRE_GPU();
  for (const std::string model : {"resnet18_small", "vgg11_bn_small"}) {
    for (const bool amp : {false, true}) {
      SCOPED_TRACE(model + (amp ? " AMP" : " FP32"));
      const StepsRun on = six_steps(model, amp, true, "1"), off = six_steps(model, amp, true, "0");
      EXPECT_GT(on.side_wgrads, 0) << "weight gradients forked to the side stream";
      EXPECT_EQ(off.side_wgrads, 0) << "KILN_SIDE_WGRAD=0";
      expect_same_bits(on, off);
    }
  }
}

// The trainer's late statistics on the GPU (Backend::read_later through a pinned ring, no
// wait for the step just enqueued): the same numbers one step late, the same weights, in FP32
// and AMP (the loss scale and overflow flag come from the update stream); misuse is an error,
// and a ticket overwritten by 64 newer reads too.
TEST(GpuStep, AsyncStatsEqualSyncOneStepLate) {
  KILN_REQUIRE_GPU();
  for (const bool amp : {false, true}) {
    SCOPED_TRACE(amp ? "amp" : "fp32");
    EngineOptions o;
    o.switches.deterministic = true;  // two engines: the same engines, the same bits
    o.device = "cuda";
    o.compile.batch = 8;
    o.compile.amp = amp;
    o.compile.momentum = 0.9f;
    async_stats_equal_sync("resnet18_small", o, 5);
  }
  EngineOptions o;
  o.switches.deterministic = true;
  o.device = "cuda";
  o.compile.batch = 4;
  Engine e(make_model("cnn"), o);
  e.lock_memory();
  e.compile(1);
  late_read_misuse_is_an_error(e);
  const Program& p = e.program();
  const uint64_t first = e.backend().read_later(p.tensor(p.io.loss));
  for (uint64_t i = 0; i < Backend::kLateReadSlots; ++i) {
    float v = 0.0f;
    e.backend().collect(e.backend().read_later(p.tensor(p.io.loss)), &v);
  }
  float v = 0.0f;
  EXPECT_THROW(e.backend().collect(first, &v), Error) << "its slot was reused";
}

// For the first tensor that disagrees: where its node's tensors live (and any other tensor
// sharing those bytes), and at the worst few elements the node's same-sized inputs on both
// backends, so a stale input (ordering) can be told from a wrong kernel or an overlap.
void explain_mismatch(const Program& p, const Node& n, TensorId bad,
                      std::vector<std::unique_ptr<Engine>>& e) {
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
    std::printf("    %-34s region %d offset %lld bytes %lld%s\n", t.name.c_str(),
                static_cast<int>(root.region), static_cast<long long>(t.offset),
                static_cast<long long>(t.bytes()), t.view_of != kNoTensor ? " (view)" : "");
    for (const DTensor& o : p.tensors) {
      if (o.id == id || o.offset < 0 || p.storage(o.id).region != root.region ||
          o.view_of != kNoTensor)
        continue;
      if (o.offset < t.offset + t.bytes() && t.offset < o.offset + o.bytes() && root.id != o.id) {
        std::printf("      overlaps %s (offset %lld bytes %lld)\n", o.name.c_str(),
                    static_cast<long long>(o.offset), static_cast<long long>(o.bytes()));
      }
    }
  }
  const auto a = fetch(0, bad), b = fetch(1, bad);
  std::vector<size_t> order(a.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::partial_sort(
      order.begin(), order.begin() + std::min<size_t>(8, order.size()), order.end(),
      [&](size_t x, size_t y) { return std::fabs(a[x] - b[x]) > std::fabs(a[y] - b[y]); });
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i)
    differing += std::fabs(a[i] - b[i]) > 1e-4 * (std::fabs(a[i]) + 1e-3);
  std::printf(
      "    %zu of %zu elements differ; worst (index: cpu gpu | same-size inputs cpu gpu):\n",
      differing, a.size());
  for (size_t k = 0; k < std::min<size_t>(8, order.size()); ++k) {
    const size_t i = order[k];
    std::printf("      %zu: %.6g %.6g |", i, a[i], b[i]);
    for (TensorId in : n.in) {
      if (in == kNoTensor || p.tensor(in).numel() != p.tensor(bad).numel() ||
          p.tensor(in).dtype != DType::F32)
        continue;
      std::printf(" %.6g %.6g", fetch(0, in)[i], fetch(1, in)[i]);
    }
    std::printf("\n");
  }
}

// One step of a model on both backends with memory reuse off (so every tensor keeps its
// last value), then every float tensor a node of the step wrote, compared in program order.
// FP32, TF32 off: forward outputs within 1e-5 of each tensor's scale (as the per-op tests),
// gradients and updates within 1e-4 (they pass through BN backward reductions that the two
// backends order differently).
//
// One thing is not rounding and not a bug: a ReLU's backward is discontinuous at 0. Where a
// ReLU input lies within FP32 rounding of zero (the CPU's 4.7e-7 against the GPU's 0, say),
// the two masks differ in that element and the backward passes on one element's full
// gradient on one backend and zero on the other; with ~10^5 elements per layer this happens
// about once a model. So a node is held to the tolerance only while its inputs agree ("clean");
// a ReLU backward whose clean inputs give different outputs must owe every differing element
// to such a flip (one side's y exactly 0, the other's within 1e-5 of y's scale), and what
// reads its output afterwards is reported, not asserted. What the test guards against - a
// kernel reading a stale or overwritten input, two tensors sharing bytes, a wrong kernel on a
// real shape - shows up as a clean node that disagrees, with no flip to explain it.
struct Placement {
  int region;
  int64_t begin, end;
};

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
    o.switches.memory_reuse = false;
    o.switches.fusion = false;  // one program for both: the CPU fuses in FP32, CUDA only under AMP
    engines.push_back(std::make_unique<Engine>(bp, o));
    engines.back()->lock_memory();
    engines.back()->compile(21);
    engines.back()->train_step(img.data(), lab.data(), 0.02f);
  }
  const Program& p = engines[0]->program();
  auto read = [&](int which, TensorId id) {
    const DTensor& t = engines[static_cast<size_t>(which)]->program().tensor(id);
    std::vector<float> v(static_cast<size_t>(t.numel()));
    engines[static_cast<size_t>(which)]->backend().read(t, v.data());
    return v;
  };
  auto place = [&](TensorId id) {
    const DTensor& t = p.tensor(id);
    return Placement{static_cast<int>(p.storage(id).region), t.offset, t.offset + t.bytes()};
  };
  std::vector<Placement> tainted;  // bytes downstream of a ReLU flip
  auto is_tainted = [&](TensorId id) {
    const Placement q = place(id);
    for (const Placement& d : tainted) {
      if (d.region == q.region && d.begin < q.end && q.begin < d.end) return true;
    }
    return false;
  };
  std::vector<bool> seen(p.tensors.size(), false);
  int clean_checked = 0, tainted_nodes = 0, flips = 0;
  bool explained = false;
  for (const Phase& ph : p.train) {
    for (const Node& n : ph.nodes) {
      bool clean = true;
      for (TensorId id : n.in) clean = clean && (id == kNoTensor || !is_tainted(id));
      for (TensorId id : n.out) {
        if (id == kNoTensor) continue;
        const DTensor& t = p.tensor(id);
        if (seen[static_cast<size_t>(id)] || t.dtype != DType::F32) continue;
        seen[static_cast<size_t>(id)] = true;
        const std::vector<float> a = read(0, id), b = read(1, id);
        const bool forward =
            (ph.kind == PhaseKind::forward_first || ph.kind == PhaseKind::forward_backward) &&
            n.label.find("bwd") == std::string::npos;
        const double err = rel_error(b, a, kSumFloor), tol = forward ? 1e-5 : 1e-4;
        if (!clean) {
          ++tainted_nodes;
          tainted.push_back(place(id));
          continue;
        }
        ++clean_checked;
        if (err < tol) continue;
        if (n.op == OpKind::relu_bwd) {
          // Every differing element must sit on a ReLU input that one backend rounded to 0
          // and the other to a value within 1e-5 of y's scale.
          const std::vector<float> ya = read(0, n.in[0]), yb = read(1, n.in[0]);
          double yscale = 1e-30, dscale = 1e-30;
          for (float v : ya) yscale = std::max(yscale, static_cast<double>(std::fabs(v)));
          for (float v : a) dscale = std::max(dscale, static_cast<double>(std::fabs(v)));
          int here = 0, unexplained = 0;
          for (size_t i = 0; i < a.size(); ++i) {
            if (std::fabs(static_cast<double>(a[i]) - b[i]) <= tol * dscale) continue;
            const bool flip = (ya[i] == 0.0f) != (yb[i] == 0.0f) &&
                              std::max(std::fabs(ya[i]), std::fabs(yb[i])) < 1e-5 * yscale;
            (flip ? here : unexplained) += 1;
          }
          EXPECT_EQ(unexplained, 0)
              << n.label << ": " << unexplained << " elements differ that no ReLU flip explains";
          std::printf(
              "  %-36s %d ReLU mask flip(s) at inputs within 1e-5 of zero; what reads %s is not "
              "asserted\n",
              n.label.c_str(), here, t.name.c_str());
          flips += here;
          tainted.push_back(place(id));
          continue;
        }
        ADD_FAILURE() << ph.name << " / " << n.label << " / " << t.name << " " << t.shape.str()
                      << ": error " << err << " of scale with agreeing inputs (tolerance " << tol
                      << ")";
        if (!explained) {
          explained = true;
          explain_mismatch(p, n, id, engines);
        }
      }
    }
  }
  std::printf("  %s: %d tensors compared with agreeing inputs, %d downstream of %d ReLU flip(s)\n",
              model.c_str(), clean_checked, tainted_nodes, flips);
  EXPECT_GT(clean_checked, 0);
}

TEST(GpuStep, EveryTensorOfACnnStepMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  every_tensor_matches("cnn");
}

TEST(GpuStep, EveryTensorOfAResNet18SmallStepMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  every_tensor_matches("resnet18_small");
}

// One step of `cnn` against PyTorch (float64, tests/data/golden_cnn.safetensors, whose batch
// keeps every ReLU input and pooling tie 1e-5 away from its kink: see make_cnn_golden.py),
// in FP32, to the CPU test's tolerances element by element. (Under AMP, FP16 rounding flips
// hundreds of ReLU masks of this batch: gpu_golden_test.cpp's CnnStepMatchesPyTorchAmp makes
// its reference follow kiln's masks instead.)
void golden_fp32() {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/data/golden_cnn.safetensors";
  const StFile g = read_safetensors(path);
  EngineOptions o;
  o.device = "cuda";
  o.compile.batch = 8;
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
  const float want_loss = floats(g.tensors.at("loss"))[0];
  EXPECT_NEAR(s.loss, want_loss, 1e-5 * std::fabs(want_loss));
  // Gradients in grads_f32 still carry the loss scale (undone inside the optimizer, S8).
  float scale = 1.0f;
  e.backend().read(e.program().tensor(e.program().io.loss_scale), &scale);
  for (const ParamDesc& d : e.program().params) {
    const auto grad = to_torch_layout(d, e.read_param(d.name, Region::grads_f32));
    const auto after = to_torch_layout(d, e.read_param(d.name));
    const auto& want_g = floats(g.tensors.at("grad." + d.name));
    const auto& want_w = floats(g.tensors.at("after." + d.name));
    const double ge = scaled_error(grad, want_g, 1.0 / scale), we = scaled_error(after, want_w);
    std::printf("  %-22s grad: %.3g of scale | after: %.3g of scale\n", d.name.c_str(), ge, we);
    EXPECT_LT(ge, 1e-4) << d.name;
    // The update moves weights by ~1e-2 of their scale: a 1e-4 gradient error is ~1e-6 of it.
    EXPECT_LT(we, 1e-5) << d.name;
  }
}

TEST(GpuStep, CnnStepMatchesPyTorchFp32) {
  KILN_REQUIRE_GPU();
  golden_fp32();
}

}  // namespace
}  // namespace kiln::test
