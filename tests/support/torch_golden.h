// A golden training step against PyTorch made at test time (SPEC Q2, issue 4): ResNet-18 and
// VGG11-BN weights are too large to commit as a golden file, so the test writes kiln's own
// initial weights and a batch to a temporary safetensors file (which kiln then imports, so
// both start from the same bytes), takes one kiln step, runs tests/golden/torch_step.py on the
// file (one SGD step in float64 on the CPU), and compares: the loss, every parameter gradient,
// and every weight and running statistic after the step.
//
// ReLUs and max-pools are decided by rounding where an input lies within ~1e-6 of a kink, and
// a ResNet-18 step at batch 4 has ~2.2M ReLU inputs: one or a few such ties per step are expected,
// and one element routed differently moves a whole channel's gradient (seen: 4e-2 of scale).
// So the reference takes kiln's decisions (read back from the step's tensors) and checks that
// each one it did not share was within tol_kink of the kink; everything else stays float64.
//
//   TEST(Golden, X) {
//     KILN_REQUIRE_TORCH(python);            // skips where no Python has torch
//     GoldenStep g;  g.model = "resnet18_small";  ...
//     run_golden_step(python, g);
//   }
//
// Python: $KILN_TEST_PYTHON if set (it must have torch: the test fails otherwise, since a
// variable set on purpose and then ignored would hide a broken setup); else /usr/bin/python3
// if it imports torch (Debian's python3-torch on CI); else python3 on PATH.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/rng.h"
#include "kiln/io/safetensors.h"
#include "kiln/plan/arch_plan.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"

namespace kiln::test {

inline bool python_has_torch(const std::string& python) {
  const std::string cmd = "'" + python + "' -c 'import torch' >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// The Python to run torch_step.py with, or "" when none has torch. Probed once per process.
inline std::string torch_python() {
  static const std::string found = [] {
    if (const char* env = std::getenv("KILN_TEST_PYTHON"); env && *env) return std::string(env);
    for (const char* p : {"/usr/bin/python3", "python3"}) {
      if (python_has_torch(p)) return std::string(p);
    }
    return std::string();
  }();
  return found;
}

#define KILN_REQUIRE_TORCH(var)                                                         \
  const std::string var = ::kiln::test::torch_python();                                 \
  if (var.empty()) {                                                                    \
    GTEST_SKIP() << "no Python with torch (tried /usr/bin/python3 and python3; set "    \
                    "KILN_TEST_PYTHON to one that has it) for the PyTorch golden step"; \
  }                                                                                     \
  ASSERT_TRUE(::kiln::test::python_has_torch(var))                                      \
      << "KILN_TEST_PYTHON=" << var << " cannot import torch"

// One golden step: the model, the backend and the step's hyper-parameters, and the
// tolerances (each a fraction: of |loss|, or of the largest magnitude of the tensor compared).
struct GoldenStep {
  std::string model;
  std::string device = "cpu";
  bool amp = false;
  int64_t batch = 4;
  uint64_t seed = 7;  // kiln's initialisation (torchvision's schemes) and the batch
  float lr = 0.1f, momentum = 0.9f, weight_decay = 5e-4f;
  bool nesterov = true;
  float initial_loss_scale = 8192.0f;  // AMP's (CompileOptions' default)
  // KILN_CUTLASS for this step (a field, not the environment): auto by default, as kiln runs.
  Auto cutlass = Auto::automatic;
  Auto cutlass_dgrad = Auto::automatic;  // KILN_CUTLASS_DGRAD likewise
  bool cutlass_timed = true;             // KILN_CUTLASS_TIMED likewise (on, as kiln runs)
  // BatchNorm weights whose name ends in this (a residual branch's last BatchNorm) are drawn
  // from [0.05, 0.15] rather than [0.5, 1.5], as in a trained ResNet or torchvision's
  // zero_init_residual (0, which would stop the branch's gradients): see resnet50_small_step.
  std::string small_gamma_suffix;
  // tol_weight: the weights after the step, beyond the gradient's tolerance carried through
  // the update (see run_golden_step): FP32 rounding of the new weight, on both sides.
  double tol_loss = 1e-5, tol_grad = 1e-4, tol_weight = 1e-6, tol_buffer = 1e-5;
  // How far from a kink (a ReLU input from 0, a max-pool's pick below its window's maximum)
  // kiln may decide differently from float64, as a fraction of that input tensor's largest
  // magnitude: the forward's own rounding (see torch_step.py --choices).
  double tol_kink = 1e-4;
};

// ResNet-50's small form, for the golden steps. With every BatchNorm weight near 1 its 16
// bottlenecks each add a branch as large as the stream, which then amplifies rounding ~20x more
// than ResNet-18 (seed 7, batch 4: PyTorch's own float32 step off its float64 step by 6.7e-5 of
// scale in the worst gradient, kiln's CPU step by 1.5e-4; under AMP, bench/golden_rounding.py's
// FP16 emulation by 0.15): a golden step there would bound gross errors only. So each branch's
// last BatchNorm (bn3) starts small, as in a trained ResNet; then the emulation's AMP errors are
// ResNet-18's (bench/RESULTS.md) and the default tolerances hold.
inline GoldenStep resnet50_small_step(const std::string& device) {
  GoldenStep g;
  g.model = "resnet50_small";
  g.device = device;
  g.small_gamma_suffix = ".bn3.weight";
  return g;
}

// What was measured, for the log (and the tests' report).
struct GoldenErrors {
  double loss = 0, grad = 0, weight = 0, buffer = 0;
  double weight_allowed = 0;  // the tolerance of the worst weight (it depends on the update)
  std::string worst_grad, worst_weight, worst_buffer;
  int64_t relu_flips = 0, pool_flips = 0;  // choices where kiln and float64 differ
  double relu_margin = 0, pool_gap = 0;    // how close to the kink they were (of scale)
  CompileReport compiled;  // how the backend built the step (CUDA: which layers took CUTLASS)
};

namespace golden_detail {

inline std::vector<float> floats(const StTensor& t) {
  EXPECT_EQ(t.dtype, DType::F32);
  std::vector<float> v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}
inline StTensor f32(std::vector<int64_t> shape, const std::vector<float>& v) {
  StTensor t;
  t.dtype = DType::F32;
  t.shape = std::move(shape);
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// Largest error relative to the tensor's own largest magnitude (as tests/e2e/golden_test.cpp),
// or `min_scale` where that is larger: a gradient's small entries are sums of cancelling terms
// whose rounding is set by the large ones. `factor` multiplies `got` first (1 / loss scale for
// AMP gradients). NaN = infinity.
inline double scaled_error(const std::vector<float>& got, const std::vector<float>& want,
                           double factor = 1.0, double min_scale = 0.0) {
  if (got.size() != want.size()) return INFINITY;
  double scale = std::max({1e-30, min_scale, max_abs(want)}), worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) * factor - want[i]);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst / scale;
}

// A fresh folder under the system's temporary directory, removed with the object unless the
// test failed or KILN_GOLDEN_KEEP is set (then its path is printed, so the files can be looked
// at; torch_step.py's docstring says what each holds).
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    path_ =
        std::filesystem::temp_directory_path() /
        ("kiln_golden_" + tag + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    if (::testing::Test::HasFailure() || std::getenv("KILN_GOLDEN_KEEP")) {
      std::printf("torch golden: files kept in %s\n", path_.c_str());
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// kiln's discrete choices of the step just taken, for torch_step.py --choices: each ReLU's
// mask ("relu.<path>", 1 where its output is > 0, which is what kiln's relu_bwd passes) and
// each max-pool's argmax ("argmax.<path>"), read back from the step's tensors (the engine is
// compiled without memory reuse, so every forward tensor still holds its value) and turned
// from NHWC into torch's NCHW. A ReLU that a fusion pass merged away is read from the fused
// node (CBR, BN+add+ReLU) whose output it became.
inline StFile kiln_choices(Engine& e) {
  const Program& p = e.program();
  const ArchPlan& plan = e.plan();
  std::map<std::string, TensorId> by_name;
  for (const DTensor& t : p.tensors) by_name[t.name] = t.id;
  auto nchw = [](const DTensor& t, const std::vector<float>& v, auto convert) {
    using T = decltype(convert(0.0f));
    std::vector<T> out(v.size());
    const auto& d = t.shape.dims;
    if (d.size() != 4) {
      for (size_t i = 0; i < v.size(); ++i) out[i] = convert(v[i]);
      return std::make_pair(d, out);
    }
    const int64_t N = d[0], H = d[1], W = d[2], C = d[3];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w)
          for (int64_t c = 0; c < C; ++c)
            out[static_cast<size_t>(((n * C + c) * H + h) * W + w)] =
                convert(v[static_cast<size_t>(((n * H + h) * W + w) * C + c)]);
    return std::make_pair(std::vector<int64_t>{N, C, H, W}, out);
  };
  auto find = [&](const std::string& name) -> const DTensor* {
    const auto it = by_name.find(name);
    EXPECT_NE(it, by_name.end()) << "no tensor '" << name << "' in the program of " << p.model;
    return it == by_name.end() ? nullptr : &p.tensor(it->second);
  };
  StFile f;
  for (const PlanNode& n : plan.nodes) {
    if (n.op == PlanOp::ReLU) {
      const PlanNode* src = &n;
      while (src->removed && !src->inputs.empty())
        src = &plan.nodes[static_cast<size_t>(src->inputs[0])];
      const DTensor* t = find(src->name + ":y");
      if (!t) continue;
      auto [shape, mask] =
          nchw(*t, read_floats(e.backend(), *t), [](float y) { return uint8_t{y > 0.0f}; });
      StTensor st;
      st.dtype = DType::U8;
      st.shape = shape;
      st.data.assign(mask.begin(), mask.end());
      f.tensors["relu." + n.name] = std::move(st);
    } else if (n.op == PlanOp::MaxPool && !n.removed) {
      const DTensor* t = find(n.name + ":argmax");
      if (!t) continue;
      auto [shape, idx] =
          nchw(*t, read_floats(e.backend(), *t), [](float i) { return static_cast<int32_t>(i); });
      StTensor st;
      st.dtype = DType::I32;
      st.shape = shape;
      st.data.resize(idx.size() * 4);
      std::memcpy(st.data.data(), idx.data(), st.data.size());
      f.tensors["argmax." + n.name] = std::move(st);
    }
  }
  return f;
}

}  // namespace golden_detail

// Runs the golden step and checks it (gtest EXPECTs); returns the errors measured.
inline GoldenErrors run_golden_step(const std::string& python, const GoldenStep& g) {
  using namespace golden_detail;
  GoldenErrors err;
  const auto t0 = std::chrono::steady_clock::now();
  const BluePrint bp = make_model(g.model);
  EngineOptions o;
  o.device = g.device;
  o.compile.batch = g.batch;
  o.compile.amp = g.amp;
  o.compile.optimizer = "sgd";
  o.compile.momentum = g.momentum;
  o.compile.nesterov = g.nesterov;
  o.compile.weight_decay = g.weight_decay;
  o.compile.initial_loss_scale = g.initial_loss_scale;
  o.switches.cutlass = g.cutlass;
  o.switches.cutlass_dgrad = g.cutlass_dgrad;
  o.switches.cutlass_timed = g.cutlass_timed;
  // Every forward tensor keeps its value after the step, for kiln_choices (placement only:
  // the kernels and their order are the same).
  o.switches.memory_reuse = false;
  // kiln_choices reads each ReLU's decisions from its output map, which a max-pool folded into
  // a CBR never writes (ops.def's cbr_pool_fwd). So the golden step keeps pools apart; the
  // folded form equals this program bit for bit (GpuFusedStep.PoolFoldingOffAndOnBitForBit,
  // Switches.PoolFoldingOffAndOnAgree), which carries the comparison over.
  o.switches.fuse_pool = false;
  // Likewise a downsampling shortcut's BatchNorm folded into BN+add+ReLU never writes its output,
  // and its shortcut convolution would take the SM90 GEMM beside the conv3 layers this test
  // counts; the folded form equals the unfolded one bit for bit (GpuFusedStep.ResidualBn
  // FoldingOffAndOnBitForBit, Switches.ResidualBnFoldingOffAndOnAgree) and to rounding on the GEMM
  // (GpuCutlassStep.Resnet50ResidualBnFoldedOnTheGemmAgrees).
  o.switches.fuse_residual_bn = false;
  Engine e(bp, o);
  e.lock_memory();
  e.compile(g.seed);  // torchvision's initialisation, drawn on the host
  const Program& p = e.program();
  err.compiled = e.backend().compile_report();

  // The initial state, in torchvision's names and layouts, as kiln exports it. torchvision
  // initialises BatchNorm to weight 1, bias 0, mean 0, var 1 and VGG's conv biases to 0: then
  // a gradient that ignored gamma, a running update that dropped the old value, or a weight
  // decay wrongly applied to biases would go unseen. So those get random values first.
  StFile in = export_state_dict(e);
  Rng rng(g.seed + 1000);
  auto perturb = [&](const std::string& name, float lo, float hi) {
    std::vector<float> v = floats(in.tensors.at(name));
    for (float& x : v) x = rng.uniform(lo, hi);
    in.tensors[name] = f32(in.tensors.at(name).shape, v);
  };
  for (const ParamDesc& d : p.params) {
    if (d.kind == ParamKind::BnWeight) {
      const std::string& tail = g.small_gamma_suffix;
      const bool small = !tail.empty() && d.name.size() >= tail.size() &&
                         d.name.compare(d.name.size() - tail.size(), tail.size(), tail) == 0;
      perturb(d.name, small ? 0.05f : 0.5f, small ? 0.15f : 1.5f);
    }
    if (d.kind == ParamKind::BnBias || d.kind == ParamKind::Bias) perturb(d.name, -0.2f, 0.2f);
  }
  for (const BufferDesc& b : p.buffers) {
    const bool var = b.name.size() > 4 && b.name.compare(b.name.size() - 4, 4, "_var") == 0;
    perturb(b.name, var ? 0.5f : -0.5f, var ? 2.0f : 0.5f);
  }
  std::vector<float> images;
  std::vector<int32_t> labels;
  // Classes 3 apart, so a batch of 4 spans the range of 10 classes.
  LearnableBatch batch = learnable_batch(bp, g.batch, g.seed, 3);
  images = std::move(batch.images);
  labels = std::move(batch.labels);
  in.tensors["input.nhwc"] =
      f32({g.batch, bp.input.height, bp.input.width, bp.input.channels}, images);
  StTensor lt;
  lt.dtype = DType::I32;
  lt.shape = {g.batch};
  lt.data.resize(labels.size() * 4);
  std::memcpy(lt.data.data(), labels.data(), lt.data.size());
  in.tensors["labels"] = lt;

  TempDir dir(g.model);
  const std::string in_path = dir.file("in.safetensors"), out_path = dir.file("torch.safetensors");
  write_safetensors(in_path, in);
  // The same file feeds kiln: the weights reach both through the safetensors import.
  import_weights(e, in_path);

  const auto t_kiln = std::chrono::steady_clock::now();
  const StepStats s = e.train_step(images.data(), labels.data(), g.lr);
  const double kiln_seconds = seconds_since(t_kiln);
  EXPECT_FALSE(s.overflow) << "the step overflowed at loss scale " << s.loss_scale
                           << ": nothing to compare";
  if (s.overflow) return err;
  const std::string choices_path = dir.file("kiln_choices.safetensors");
  write_safetensors(choices_path, kiln_choices(e));

  char hyper[256];
  std::snprintf(hyper, sizeof hyper, " --lr %.9g --momentum %.9g --weight-decay %.9g%s", g.lr,
                g.momentum, g.weight_decay, g.nesterov ? " --nesterov" : "");
  const std::string cmd = "'" + python + "' '" + std::string(KILN_SOURCE_DIR) +
                          "/tests/golden/torch_step.py' " + g.model + " '" + in_path + "' '" +
                          out_path + "'" + hyper + " --choices '" + choices_path + "'";
  const auto t_py = std::chrono::steady_clock::now();
  const int rc = std::system(cmd.c_str());
  const double py_seconds = seconds_since(t_py);
  EXPECT_EQ(rc, 0) << cmd;
  if (rc != 0) return err;
  const StFile want = read_safetensors(out_path);

  // The reference followed kiln wherever the two decided a ReLU or a max-pool differently;
  // that is only right where the float64 value is within the forward's rounding of the kink.
  const std::vector<float> kinks = floats(want.tensors.at("check.kinks"));
  err.relu_flips = static_cast<int64_t>(kinks[0]);
  err.relu_margin = kinks[1];
  err.pool_flips = static_cast<int64_t>(kinks[2]);
  err.pool_gap = kinks[3];
  EXPECT_LE(err.relu_margin, g.tol_kink)
      << err.relu_flips << " ReLU(s) decided differently from float64";
  EXPECT_LE(err.pool_gap, g.tol_kink)
      << err.pool_flips << " max-pool pick(s) differ from float64's";

  const float want_loss = floats(want.tensors.at("loss"))[0];
  err.loss = std::fabs(static_cast<double>(s.loss) - want_loss) / std::fabs(want_loss);
  EXPECT_LE(err.loss, g.tol_loss) << g.model << ": loss " << s.loss << ", PyTorch " << want_loss;

  // grads_f32 holds the gradients still multiplied by the loss scale (it is undone inside the
  // optimizer, S8); the scale is 1 without AMP.
  float scale = 1.0f;
  e.backend().read(p.tensor(p.io.loss_scale), &scale);
  for (const ParamDesc& d : p.params) {
    const auto grad = to_torch_layout(d, e.read_param(d.name, Region::grads_f32));
    // A bias's gradient sums the same terms as its layer's weight gradient (dy, against
    // x * dy), so its rounding is on that scale too. This matters for a conv bias in front of
    // a BatchNorm (VGG): the mean subtraction cancels it, its exact gradient is 0 (float64
    // gives ~1e-17), and kiln's FP32 rounding residue can only be judged on that scale.
    double min_scale = 0;
    if (d.name.size() > 5 && d.name.compare(d.name.size() - 5, 5, ".bias") == 0) {
      const auto w = want.tensors.find("grad." + d.name.substr(0, d.name.size() - 5) + ".weight");
      if (w != want.tensors.end()) min_scale = max_abs(floats(w->second));
    }
    const double eg =
        scaled_error(grad, floats(want.tensors.at("grad." + d.name)), 1.0 / scale, min_scale);
    EXPECT_LE(eg, g.tol_grad) << "gradient of " << d.name;
    if (eg >= err.grad) err.grad = eg, err.worst_grad = d.name;
    // The first step from zero momentum moves a weight by lr * (1 + momentum) * (g + wd * w)
    // with Nesterov, lr * (g + wd * w) without: a gradient error within tol_grad of the scale
    // judged above moves the new weight by that times lr * (1 + momentum), on top of FP32
    // rounding. With lr 0.1 at batch 4 the update is 1e-3 to 1 of a tensor's scale (fc and
    // stem weights move by about their own size), so a fixed tolerance would be loose for
    // some tensors and wrong for others.
    const std::vector<float> want_after = floats(want.tensors.at("after." + d.name));
    const double grad_scale =
        std::max(min_scale, max_abs(floats(want.tensors.at("grad." + d.name))));
    const double step = g.lr * (g.nesterov ? 1.0 + g.momentum : 1.0);
    const double tol_w =
        g.tol_weight + g.tol_grad * step * grad_scale / std::max(max_abs(want_after), 1e-30);
    const auto after = to_torch_layout(d, e.read_param(d.name));
    const double ew = scaled_error(after, want_after);
    EXPECT_LE(ew, tol_w) << "weights of " << d.name << " after the step";
    if (ew / tol_w >= err.weight / std::max(err.weight_allowed, 1e-30)) {
      err.weight = ew, err.weight_allowed = tol_w, err.worst_weight = d.name;
    }
  }
  for (const BufferDesc& b : p.buffers) {
    const double eb =
        scaled_error(e.read_param(b.name), floats(want.tensors.at("after." + b.name)));
    EXPECT_LE(eb, g.tol_buffer) << b.name << " after the step";
    if (eb >= err.buffer) err.buffer = eb, err.worst_buffer = b.name;
  }
  if (::testing::Test::HasFailure() || std::getenv("KILN_GOLDEN_KEEP")) {
    // kiln's side under torch_step.py's names, next to its output in the kept folder.
    StFile mine;
    mine.tensors["loss"] = f32({1}, {s.loss});
    for (const ParamDesc& d : p.params) {
      std::vector<float> grad = to_torch_layout(d, e.read_param(d.name, Region::grads_f32));
      for (float& x : grad) x /= scale;
      mine.tensors["grad." + d.name] = f32(d.torch_shape.dims, grad);
      mine.tensors["after." + d.name] =
          f32(d.torch_shape.dims, to_torch_layout(d, e.read_param(d.name)));
    }
    for (const BufferDesc& b : p.buffers) {
      mine.tensors["after." + b.name] = f32(p.tensor(b.tensor).shape.dims, e.read_param(b.name));
    }
    write_safetensors(dir.file("kiln.safetensors"), mine);
  }
  std::printf(
      "torch golden %s on %s%s, batch %lld: loss %.7g (PyTorch %.7g, error %.2g); worst gradient "
      "%.2g "
      "(%s), weight %.2g (%s, allowed %.2g), running stat %.2g (%s); ReLU choices off float64's: "
      "%lld "
      "(within %.2g of scale), max-pool: %lld (within %.2g); kiln's step %.2f s, PyTorch's %.1f s, "
      "all %.1f s\n",
      g.model.c_str(), g.device.c_str(), g.amp ? " AMP" : "", static_cast<long long>(g.batch),
      s.loss, want_loss, err.loss, err.grad, err.worst_grad.c_str(), err.weight,
      err.worst_weight.c_str(), err.weight_allowed, err.buffer, err.worst_buffer.c_str(),
      static_cast<long long>(err.relu_flips), err.relu_margin,
      static_cast<long long>(err.pool_flips), err.pool_gap, kiln_seconds, py_seconds,
      seconds_since(t0));
  return err;
}

}  // namespace kiln::test
