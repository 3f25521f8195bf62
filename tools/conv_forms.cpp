// kiln_conv_forms: the question to answer before the MLPerf-style CBR form is built - do cuDNN's
// fused convolution graphs cost less than the passes they would remove?
//
// For each of ResNet-50's convolutions that read a CBR's output (each bottleneck's 3x3 and
// last 1x1; FP16 NHWC, batch 256 by default) it times the fastest engine of seven graphs:
//   fprop                   plain forward convolution (what kiln runs now)
//   fprop+genstats          conv and its output's sums in one graph (KILN_CBR_FORM=genstats)
//   prologue fprop+genstats relu(z * scale + bias) applied while loading the input, then the
//                           convolution and its output's per-channel sums: the MLPerf form,
//                           in which the producing CBR never writes its normalised output
//   dgrad                   plain data gradient
//   dgrad+drelu+dbn_weight  the data gradient, ReLU's backward from the recomputed
//                           pre-activation z * scale + bias, and BatchNorm's weight-gradient
//                           sums (the MLPerf form's backward: no separate BN sums pass)
//   wgrad                   plain weight gradient
//   prologue wgrad          the weight gradient of relu(z * scale + bias), recomputed
// and prints a table and the per-step totals over ResNet-50's layers. Engines: cuDNN's
// heuristics (modes A and FALLBACK), the first --max-engines of each graph that build, one
// untimed run then five timed (median). Speed only: the graphs' results are not checked here
// (the form that gets built is tested against its unfused chain under tests/gpu). Needs a GPU
// (exit 77 without one); exits 1 if a plain convolution finds no engine, while a fused graph
// without one is a finding, listed under the table.
//
//   kiln_conv_forms [--batch 256] [--max-engines 3] [--only N]   (--only: the first N shapes)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;

namespace {

#define PROBE_CUDA(call)                                                                       \
  do {                                                                                         \
    const cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "kiln_conv_forms: %s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Shape {
  const char* name;
  int count;                   // such layers in one ResNet-50 step
  int64_t h, c, k, r, stride;  // input height = width, channels in, out, kernel, stride
  int64_t p() const { return (h + 2 * (r / 2) - r) / stride + 1; }
};

// torchvision's ResNet-50 (v1.5: the stride on the 3x3): per stage, the first block's 3x3 may
// have stride 2; the last 1x1 widens by 4.
const Shape kShapes[] = {
    {"s1 3x3 64", 3, 56, 64, 64, 3, 1},         {"s1 1x1 64>256", 3, 56, 64, 256, 1, 1},
    {"s2 3x3 128 /2", 1, 56, 128, 128, 3, 2},   {"s2 3x3 128", 3, 28, 128, 128, 3, 1},
    {"s2 1x1 128>512", 4, 28, 128, 512, 1, 1},  {"s3 3x3 256 /2", 1, 28, 256, 256, 3, 2},
    {"s3 3x3 256", 5, 14, 256, 256, 3, 1},      {"s3 1x1 256>1024", 6, 14, 256, 1024, 1, 1},
    {"s4 3x3 512 /2", 1, 14, 512, 512, 3, 2},   {"s4 3x3 512", 2, 7, 512, 512, 3, 1},
    {"s4 1x1 512>2048", 3, 7, 512, 2048, 1, 1},
};

enum Uid : int64_t {
  X = 1,
  W,
  Y,
  DY,
  DX,
  DW,
  SCALE,
  BIAS,
  SUM,
  SQSUM,
  MEAN,
  INVSTD,
  GAMMA,
  DRELU,
  DSCALE,
  DBIAS,
  EQ_DY,
  EQ_X,
  EQ_BIAS
};

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

std::vector<int64_t> nchw(int64_t n, int64_t c, int64_t h) {
  return {n, c, h, h};
}
std::vector<int64_t> nhwc_strides(int64_t c, int64_t h) {
  return {h * h * c, 1, h * c, c};
}

struct Builder {
  fe::graph::Graph g;
  int64_t n;
  const Shape& s;
  std::vector<int64_t> uids;  // every tensor given a buffer
  Builder(int64_t batch, const Shape& shape) : n(batch), s(shape) {
    g.set_io_data_type(fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
  }
  TensorPtr act(Uid uid, const char* name, int64_t c, int64_t h) {
    uids.push_back(uid);
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim(nchw(n, c, h))
                        .set_stride(nhwc_strides(c, h))
                        .set_data_type(fe::DataType_t::HALF));
  }
  TensorPtr weight(Uid uid) {
    uids.push_back(uid);
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name("w")
                        .set_uid(uid)
                        .set_dim({s.k, s.c, s.r, s.r})
                        .set_stride({s.r * s.r * s.c, 1, s.r * s.c, s.c})
                        .set_data_type(fe::DataType_t::HALF));
  }
  TensorPtr per_channel(Uid uid, const char* name, int64_t c, fe::DataType_t dt) {
    uids.push_back(uid);
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({1, c, 1, 1})
                        .set_stride({c, 1, c, c})
                        .set_data_type(dt));
  }
  void out_act(const TensorPtr& t, Uid uid, int64_t c, int64_t h) {
    uids.push_back(uid);
    t->set_output(true)
        .set_uid(uid)
        .set_dim(nchw(n, c, h))
        .set_stride(nhwc_strides(c, h))
        .set_data_type(fe::DataType_t::HALF);
  }
  void out_channel(const TensorPtr& t, Uid uid, int64_t c) {
    uids.push_back(uid);
    t->set_output(true)
        .set_uid(uid)
        .set_dim({1, c, 1, 1})
        .set_stride({c, 1, c, c})
        .set_data_type(fe::DataType_t::FLOAT);
  }
  TensorPtr pw(fe::PointwiseMode_t mode, const TensorPtr& a, const TensorPtr& b = nullptr) {
    auto attrs = fe::graph::Pointwise_attributes().set_mode(mode).set_compute_data_type(
        fe::DataType_t::FLOAT);
    return b ? g.pointwise(a, b, attrs) : g.pointwise(a, attrs);
  }
  // z * scale + bias (FP16 scale and bias: FP32 ones have no engine on the conv prologue).
  TensorPtr pre_activation(const TensorPtr& z) {
    auto scale = per_channel(SCALE, "scale", s.c, fe::DataType_t::HALF);
    auto bias = per_channel(BIAS, "bias", s.c, fe::DataType_t::HALF);
    return pw(fe::PointwiseMode_t::ADD, pw(fe::PointwiseMode_t::MUL, z, scale), bias);
  }
  fe::graph::Conv_fprop_attributes fprop_attrs() const {
    return fe::graph::Conv_fprop_attributes()
        .set_padding({s.r / 2, s.r / 2})
        .set_stride({s.stride, s.stride})
        .set_dilation({1, 1});
  }
  fe::graph::Conv_dgrad_attributes dgrad_attrs() const {
    return fe::graph::Conv_dgrad_attributes()
        .set_padding({s.r / 2, s.r / 2})
        .set_stride({s.stride, s.stride})
        .set_dilation({1, 1});
  }
  fe::graph::Conv_wgrad_attributes wgrad_attrs() const {
    return fe::graph::Conv_wgrad_attributes()
        .set_padding({s.r / 2, s.r / 2})
        .set_stride({s.stride, s.stride})
        .set_dilation({1, 1});
  }
  void genstats(const TensorPtr& y) {
    auto [sum, sq] = g.genstats(
        y, fe::graph::Genstats_attributes().set_compute_data_type(fe::DataType_t::FLOAT));
    out_channel(sum, SUM, s.k);
    out_channel(sq, SQSUM, s.k);
  }
};

enum class Form {
  fprop,
  fprop_genstats,
  prologue_fprop_genstats,
  dgrad,
  dgrad_drelu_dbn,
  wgrad,
  prologue_wgrad
};
const char* kFormName[] = {"fprop",         "fprop+genstats",         "prologue fprop+genstats",
                           "dgrad",         "dgrad+drelu+dbn_weight", "wgrad",
                           "prologue wgrad"};

void build_form(Builder& b, Form f) {
  const Shape& s = b.s;
  switch (f) {
    case Form::fprop:
    case Form::fprop_genstats:
    case Form::prologue_fprop_genstats: {
      TensorPtr x = b.act(X, f == Form::prologue_fprop_genstats ? "z" : "x", s.c, s.h);
      if (f == Form::prologue_fprop_genstats)
        x = b.pw(fe::PointwiseMode_t::RELU_FWD, b.pre_activation(x));
      auto y = b.g.conv_fprop(x, b.weight(W), b.fprop_attrs());
      b.out_act(y, Y, s.k, s.p());
      if (f != Form::fprop) b.genstats(y);
      break;
    }
    case Form::dgrad:
    case Form::dgrad_drelu_dbn: {
      auto da = b.g.conv_dgrad(b.act(DY, "dy", s.k, s.p()), b.weight(W), b.dgrad_attrs());
      if (f == Form::dgrad) {
        b.out_act(da, DX, s.c, s.h);
        break;
      }
      da->set_dim(nchw(b.n, s.c, s.h)).set_stride(nhwc_strides(s.c, s.h));
      // ReLU's backward takes the forward input: the pre-activation, recomputed from z. Its
      // output (the gradient at BN's output) is written: BN's dx pass reads it next.
      auto z = b.act(X, "z", s.c, s.h);
      auto dpre = b.pw(fe::PointwiseMode_t::RELU_BWD, da, b.pre_activation(z));
      b.out_act(dpre, DRELU, s.c, s.h);
      auto mean = b.per_channel(MEAN, "mean", s.c, fe::DataType_t::FLOAT);
      auto invstd = b.per_channel(INVSTD, "invstd", s.c, fe::DataType_t::FLOAT);
      auto gamma = b.per_channel(GAMMA, "gamma", s.c, fe::DataType_t::FLOAT);
      auto [dscale, dbias, eq_dy, eq_x, eq_bias] =
          b.g.dbn_weight(dpre, z, mean, invstd, gamma, fe::graph::DBN_weight_attributes());
      b.out_channel(dscale, DSCALE, s.c);
      b.out_channel(dbias, DBIAS, s.c);
      b.out_channel(eq_dy, EQ_DY, s.c);
      b.out_channel(eq_x, EQ_X, s.c);
      b.out_channel(eq_bias, EQ_BIAS, s.c);
      break;
    }
    case Form::wgrad:
    case Form::prologue_wgrad: {
      TensorPtr x = b.act(X, f == Form::prologue_wgrad ? "z" : "x", s.c, s.h);
      if (f == Form::prologue_wgrad) x = b.pw(fe::PointwiseMode_t::RELU_FWD, b.pre_activation(x));
      auto dw = b.g.conv_wgrad(b.act(DY, "dy", s.k, s.p()), x, b.wgrad_attrs());
      b.uids.push_back(DW);
      dw->set_output(true)
          .set_uid(DW)
          .set_dim({s.k, s.c, s.r, s.r})
          .set_stride({s.r * s.r * s.c, 1, s.r * s.c, s.c})
          .set_data_type(fe::DataType_t::HALF);
      break;
    }
  }
}

// Device buffers large enough for every shape, filled once with small values (timings do not
// depend on them, but NaN or denormal inputs could).
struct Buffers {
  std::unordered_map<int64_t, void*> by_uid;
  Buffers(int64_t n) {
    int64_t act = 0, w = 0, ch = 0;
    for (const Shape& s : kShapes) {
      act = std::max({act, n * s.h * s.h * s.c, n * s.p() * s.p() * s.k});
      w = std::max(w, s.k * s.c * s.r * s.r);
      ch = std::max({ch, s.c, s.k});
    }
    std::vector<__half> host(static_cast<size_t>(act));
    for (size_t i = 0; i < host.size(); ++i)
      host[i] = __float2half(0.01f * static_cast<float>(static_cast<int>(i * 7919 % 201) - 100));
    std::vector<float> ones(static_cast<size_t>(ch), 1.0f);
    for (Uid u : {X, Y, DY, DX, DRELU}) alloc(u, host.data(), act * 2);
    for (Uid u : {W, DW}) alloc(u, host.data(), w * 2);
    for (Uid u : {SCALE, BIAS}) alloc(u, host.data(), ch * 2);
    for (Uid u : {SUM, SQSUM, MEAN, INVSTD, GAMMA, DSCALE, DBIAS, EQ_DY, EQ_X, EQ_BIAS})
      alloc(u, ones.data(), ch * 4);
  }
  void alloc(Uid u, const void* init, int64_t bytes) {
    void* p = nullptr;
    PROBE_CUDA(cudaMalloc(&p, static_cast<size_t>(bytes)));
    PROBE_CUDA(cudaMemcpy(p, init, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
    by_uid[u] = p;
  }
  ~Buffers() {
    for (auto& [u, p] : by_uid) cudaFree(p);
  }
};

struct Best {
  float ms = -1;  // -1: no engine ran
  float first_ms =
      -1;  // the first engine that ran: cuDNN's heuristic choice, what kiln takes untuned
  std::string engine, why;
  int tried = 0;
};

// The fastest of the first `max_engines` engines that build and run.
Best time_form(cudnnHandle_t handle, cudaStream_t stream, Buffers& buf, int64_t n, const Shape& s,
               Form f, int max_engines) {
  Builder b(n, s);
  build_form(b, f);
  Best best;
  auto failed = [&](fe::error_t e, const char* step) {
    best.why = std::string(step) + ": " + e.get_message();
    return best;
  };
  if (auto e = b.g.validate(); e.is_bad()) return failed(e, "validate");
  if (auto e = b.g.build_operation_graph(handle); e.is_bad())
    return failed(e, "build_operation_graph");
  if (auto e = b.g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
      e.is_bad())
    return failed(e, "create_execution_plans");
  if (auto e = b.g.check_support(handle); e.is_bad()) return failed(e, "check_support");
  // The variant pack holds exactly the graph's own tensors.
  std::unordered_map<int64_t, void*> pack;
  for (int64_t uid : b.uids) pack[uid] = buf.by_uid.at(uid);
  const int64_t count = b.g.get_execution_plan_count();
  cudaEvent_t t0, t1;
  PROBE_CUDA(cudaEventCreate(&t0));
  PROBE_CUDA(cudaEventCreate(&t1));
  for (int64_t i = 0; i < count && best.tried < max_engines; ++i) {
    if (b.g.build_plan_at_index(i).is_bad()) continue;
    int64_t ws = 0;
    if (b.g.get_workspace_size_plan_at_index(i, ws).is_bad()) continue;
    void* wsp = nullptr;
    if (ws > 0 && cudaMalloc(&wsp, static_cast<size_t>(ws)) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    ++best.tried;
    std::vector<float> ms;
    bool ok = true;
    for (int r = 0; r < 6 && ok; ++r) {
      PROBE_CUDA(cudaEventRecord(t0, stream));
      ok = b.g.execute_plan_at_index(handle, pack, wsp, i).is_good();
      PROBE_CUDA(cudaEventRecord(t1, stream));
      PROBE_CUDA(cudaEventSynchronize(t1));
      float t = 0;
      PROBE_CUDA(cudaEventElapsedTime(&t, t0, t1));
      if (r > 0) ms.push_back(t);
      if (r == 0 && best.ms > 0 && t > 4 * best.ms)
        break;  // far slower than the best: one run is enough
    }
    if (cudaGetLastError() != cudaSuccess) ok = false;
    if (wsp) PROBE_CUDA(cudaFree(wsp));
    if (!ok || ms.empty()) continue;
    std::sort(ms.begin(), ms.end());
    const float median = ms[ms.size() / 2];
    if (best.first_ms < 0) best.first_ms = median;
    if (best.ms < 0 || median < best.ms) {
      best.ms = median;
      if (b.g.get_plan_name_at_index(i, best.engine).is_bad())
        best.engine = "engine " + std::to_string(i);
    }
  }
  PROBE_CUDA(cudaEventDestroy(t0));
  PROBE_CUDA(cudaEventDestroy(t1));
  if (best.ms < 0 && best.why.empty())
    best.why = std::to_string(count) + " plans, none built and ran";
  return best;
}

int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: kiln_conv_forms [--batch 256] [--max-engines 3] [--only N]\n");
      return 0;
    }
    if (a != "--batch" && a != "--max-engines" && a != "--only") {
      std::fprintf(
          stderr,
          "kiln_conv_forms: unknown flag %s; its flags are --batch, --max-engines, --only\n",
          a.c_str());
      return 2;
    }
    ++i;
  }
  const int64_t n = flag(argc, argv, "--batch", 256);
  const int max_engines = static_cast<int>(flag(argc, argv, "--max-engines", 3));
  const int64_t only = flag(argc, argv, "--only", 0);
  if (n < 1 || max_engines < 1) {
    std::fprintf(stderr, "kiln_conv_forms: --batch and --max-engines must be >= 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "kiln_conv_forms: no CUDA device; this probe times cuDNN graphs on a GPU\n");
    return 77;  // ctest's SKIP_RETURN_CODE
  }
  cudaDeviceProp prop{};
  PROBE_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  PROBE_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS ||
      cudnnSetStream(handle, stream) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "kiln_conv_forms: cudnnCreate failed\n");
    return 1;
  }
  Buffers buf(n);
  std::printf(
      "# %s, cuDNN %zu, batch %lld, FP16 NHWC, fastest of the first %d engines per graph (ms)\n",
      prop.name, cudnnGetVersion(), static_cast<long long>(n), max_engines);
  std::printf("| layer | per step |");
  for (const char* f : kFormName) std::printf(" %s |", f);
  std::printf("\n|---|---|");
  for (size_t i = 0; i < std::size(kFormName); ++i) std::printf("---|");
  std::printf("\n");
  constexpr int kForms = 7;
  double total[kForms] = {};
  std::vector<std::string> notes;
  bool plain_failed =
      false;  // a plain convolution without any engine is an error, a fused one a finding
  int64_t done = 0;
  for (const Shape& s : kShapes) {
    if (only > 0 && done++ >= only) break;
    std::printf("| %s | %d |", s.name, s.count);
    for (int f = 0; f < kForms; ++f) {
      const Best r = time_form(handle, stream, buf, n, s, static_cast<Form>(f), max_engines);
      if (r.ms < 0) {
        std::printf(" none |");
        notes.push_back(std::string(s.name) + ", " + kFormName[f] + ": " + r.why);
        total[f] = -1e30;
        const auto form = static_cast<Form>(f);
        plain_failed |= form == Form::fprop || form == Form::dgrad || form == Form::wgrad;
      } else {
        std::printf(" %.3f |", r.ms);
        total[f] += r.ms * s.count;
        char first[64];
        std::snprintf(first, sizeof first, "; the first, %.3f ms", r.first_ms);
        notes.push_back(std::string(s.name) + ", " + kFormName[f] + ": " + r.engine + " (" +
                        std::to_string(r.tried) + " tried" + first + ")");
      }
      std::fflush(stdout);
    }
    std::printf("\n");
  }
  std::printf("| **per step** | |");
  for (double t : total) t < 0 ? std::printf(" - |") : std::printf(" %.2f |", t);
  std::printf("\n\nengines:\n");
  for (const std::string& s : notes) std::printf("  %s\n", s.c_str());
  cudnnDestroy(handle);
  PROBE_CUDA(cudaStreamDestroy(stream));
  if (plain_failed)
    std::fprintf(stderr, "kiln_conv_forms: a plain convolution ran on no engine (see above)\n");
  return plain_failed ? 1 : 0;
}
