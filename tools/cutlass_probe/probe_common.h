// The probe's host helpers shared by its comparisons (cutlass_probe.cpp: the 1x1 forward with
// BatchNorm's statistics; dgrad_probe.cpp: the data gradient with BatchNorm-backward's sums;
// conv_probe.cpp: 3x3 convolutions with the statistics): checked CUDA calls, event timing,
// cuDNN's convolutions, flags.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "probe_kernels.h"

#define PROBE_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "kiln_cutlass_probe: %s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace kiln::probe {

namespace fe = cudnn_frontend;

// The median of reps runs of fn, each between two events, all queued before the first wait so
// that the host's launch cost hides behind the GPU's work.
inline float median_ms(cudaStream_t s, int reps, const std::function<bool()>& fn) {
  for (int i = 0; i < 3; ++i)
    if (!fn()) return -1;
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(reps));
  for (auto& e : ev) PROBE_CUDA(cudaEventCreate(&e));
  bool ok = true;
  for (int i = 0; i < reps && ok; ++i) {
    PROBE_CUDA(cudaEventRecord(ev[2 * i], s));
    ok = fn();
    PROBE_CUDA(cudaEventRecord(ev[2 * i + 1], s));
  }
  PROBE_CUDA(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int i = 0; i < reps && ok; ++i) {
    float t = 0;
    PROBE_CUDA(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) PROBE_CUDA(cudaEventDestroy(e));
  if (!ok || ms.empty()) return -1;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// cuDNN's convolution of one shape (x [n][h][h][c], w [k][r][r][c], y [n][p][p][k] NHWC, with
// p = (h + 2 pad - r) / stride + 1; 1x1 stride 1 unless said): the forward y = conv(x, w), with
// dgrad the data gradient x = dgrad(y, w), with wgrad the weight gradient w = wgrad(x, y); its
// fastest engine chosen by timing.
struct CudnnConv {
  fe::graph::Graph g;
  int64_t plan = -1;
  void* ws = nullptr;
  std::string engine, why;
  float ms = -1;
  std::unordered_map<int64_t, void*> pack;

  enum : int64_t { X = 1, W, Y };

  bool build(cudnnHandle_t handle, cudaStream_t s, int64_t n, int64_t h, int64_t c, int64_t k,
             void* x, void* w, void* y, int max_engines, int reps, bool dgrad = false,
             int64_t r = 1, int64_t pad = 0, int64_t stride = 1, bool wgrad = false) {
    g.set_io_data_type(fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const std::vector<int64_t> xdim{n, c, h, h}, xstr{h * h * c, 1, h * c, c};
    const int64_t p = (h + 2 * pad - r) / stride + 1;
    const std::vector<int64_t> ydim{n, k, p, p}, ystr{p * p * k, 1, p * k, k};
    if (wgrad) {
      auto tx = g.tensor(
          fe::graph::Tensor_attributes().set_name("x").set_uid(X).set_dim(xdim).set_stride(xstr));
      auto ty = g.tensor(
          fe::graph::Tensor_attributes().set_name("dy").set_uid(Y).set_dim(ydim).set_stride(ystr));
      auto tw = g.conv_wgrad(ty, tx,
                             fe::graph::Conv_wgrad_attributes()
                                 .set_padding({pad, pad})
                                 .set_stride({stride, stride})
                                 .set_dilation({1, 1}));
      tw->set_output(true)
          .set_uid(W)
          .set_dim({k, c, r, r})
          .set_stride({r * r * c, 1, r * c, c})
          .set_data_type(fe::DataType_t::FLOAT);
    } else {
      auto tw = g.tensor(fe::graph::Tensor_attributes()
                             .set_name("w")
                             .set_uid(W)
                             .set_dim({k, c, r, r})
                             .set_stride({r * r * c, 1, r * c, c}));
      if (dgrad) {
        auto ty = g.tensor(
            fe::graph::Tensor_attributes().set_name("dy").set_uid(Y).set_dim(ydim).set_stride(
                ystr));
        auto tx = g.conv_dgrad(ty, tw,
                               fe::graph::Conv_dgrad_attributes()
                                   .set_padding({pad, pad})
                                   .set_stride({stride, stride})
                                   .set_dilation({1, 1}));
        tx->set_output(true).set_uid(X).set_dim(xdim).set_stride(xstr).set_data_type(
            fe::DataType_t::HALF);
      } else {
        auto tx = g.tensor(
            fe::graph::Tensor_attributes().set_name("x").set_uid(X).set_dim(xdim).set_stride(xstr));
        auto ty = g.conv_fprop(tx, tw,
                               fe::graph::Conv_fprop_attributes()
                                   .set_padding({pad, pad})
                                   .set_stride({stride, stride})
                                   .set_dilation({1, 1}));
        ty->set_output(true).set_uid(Y).set_dim(ydim).set_stride(ystr).set_data_type(
            fe::DataType_t::HALF);
      }
    }
    pack = {{X, x}, {W, w}, {Y, y}};
    auto failed = [&](fe::error_t e, const char* step) {
      why = std::string(step) + ": " + e.get_message();
      return false;
    };
    if (auto e = g.validate(); e.is_bad()) return failed(e, "validate");
    if (auto e = g.build_operation_graph(handle); e.is_bad())
      return failed(e, "build_operation_graph");
    if (auto e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
        e.is_bad())
      return failed(e, "create_execution_plans");
    if (auto e = g.check_support(handle); e.is_bad()) return failed(e, "check_support");
    int tried = 0;
    for (int64_t i = 0; i < g.get_execution_plan_count() && tried < max_engines; ++i) {
      if (g.build_plan_at_index(i).is_bad()) continue;
      int64_t bytes = 0;
      if (g.get_workspace_size_plan_at_index(i, bytes).is_bad()) continue;
      void* p = nullptr;
      if (bytes > 0 && cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      ++tried;
      const float t =
          median_ms(s, reps, [&] { return g.execute_plan_at_index(handle, pack, p, i).is_good(); });
      if (cudaGetLastError() == cudaSuccess && t > 0 && (ms < 0 || t < ms)) {
        if (ws) PROBE_CUDA(cudaFree(ws));
        ws = p;
        ms = t;
        plan = i;
        if (g.get_plan_name_at_index(i, engine).is_bad()) engine = "engine " + std::to_string(i);
      } else if (p) {
        PROBE_CUDA(cudaFree(p));
      }
    }
    if (plan < 0) why = std::to_string(tried) + " engines tried, none ran";
    return plan >= 0;
  }
  bool run(cudnnHandle_t handle) {
    return g.execute_plan_at_index(handle, pack, ws, plan).is_good();
  }
  ~CudnnConv() {
    if (ws) cudaFree(ws);
  }
};

inline int64_t flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  return fallback;
}

inline __half* as_half(void* p) {
  return static_cast<__half*>(p);
}

inline void* device_alloc(size_t bytes) {
  void* p = nullptr;
  PROBE_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

// One run of an SM90 unit's kernel (sm90::UnitKernel) on problem p, waited for: "" when it ran,
// else CUTLASS's or CUDA's words.
template <class UnitKernel, class Problem>
std::string run_and_wait(const UnitKernel& kern, const Problem& p, void* ws, cudaStream_t s) {
  const std::string err = kern.run(p, ws, s);
  const cudaError_t sync = cudaStreamSynchronize(s);
  if (!err.empty()) return err;
  return sync == cudaSuccess ? "" : cudaGetErrorString(sync);
}

// What a forward variant's z and sums are checked by (cutlass_probe.cpp, conv_probe.cpp).
struct StatsCheck {
  float z_err = 0;                    // the largest |z - zref|
  unsigned long long z_over = 0;      // elements outside the bound
  double sum_err = 0, sumsq_err = 0;  // see check_stats
  bool ok = false;
};

// z [rows][k] against zref within rel_tol * |zref| + abs_tol (compare_half); where `sums`
// (device [sum; sumsq] [2][k]) is non-null, the sums against kiln's double sums href: the mean's
// error counts against z's spread (which BatchNorm divides by, not against the mean, near zero
// here), the sum of squares relative. 1e-4: FP32 sums over at most a few thousand terms per
// thread and partial (each rounding 2^-24 relative) stay well inside it, while a lost or doubled
// tile (1 / M tiles >= 1.6e-4 of sum z^2 at these sizes) does not.
inline StatsCheck check_stats(const __half* z, const __half* zref, int64_t rows, int64_t k,
                              float rel_tol, float abs_tol, const float* sums,
                              const std::vector<double2>& href, unsigned long long* cmp,
                              cudaStream_t s) {
  PROBE_CUDA(compare_half(z, zref, rows * k, rel_tol, abs_tol, cmp, s));
  unsigned long long hc[2];
  PROBE_CUDA(cudaMemcpyAsync(hc, cmp, sizeof hc, cudaMemcpyDeviceToHost, s));
  std::vector<float> hs(2 * static_cast<size_t>(k));
  if (sums != nullptr)
    PROBE_CUDA(
        cudaMemcpyAsync(hs.data(), sums, hs.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
  PROBE_CUDA(cudaStreamSynchronize(s));
  StatsCheck r;
  const auto bits = static_cast<unsigned>(hc[0]);
  std::memcpy(&r.z_err, &bits, sizeof r.z_err);
  r.z_over = hc[1];
  r.ok = hc[1] == 0;
  if (sums != nullptr) {
    for (int64_t j = 0; j < k; ++j) {
      const double rs = href[j].x, rq = href[j].y;
      r.sum_err = std::max(r.sum_err, std::fabs(hs[j] - rs) / std::sqrt(rows * rq));
      r.sumsq_err = std::max(r.sumsq_err, std::fabs(hs[k + j] - rq) / rq);
      if (!std::isfinite(hs[j]) || !std::isfinite(hs[k + j])) r.sum_err = r.sumsq_err = INFINITY;
    }
    r.ok = r.ok && r.sum_err <= 1e-4 && r.sumsq_err <= 1e-4;
  }
  return r;
}

// The largest |a - b| that compare_half left in a result copied to the host (a float's bits).
inline float worst_of(const unsigned long long (&result)[2]) {
  float worst;
  const auto bits = static_cast<unsigned>(result[0]);
  std::memcpy(&worst, &bits, sizeof worst);
  return worst;
}

// BatchNorm-backward's sums from a kernel's epilogue (device `sums`, [2][n]: sum g, sum
// g (z - mean)) against kiln's double sums of the kernel's own g [m][n] over z, each error
// relative to sqrt(m) (the size of a sum of m signed unit-scale terms that cancel; g and z - mean
// are O(1) in the probes), so that a lost or doubled tile (256 of m terms) shows while FP32
// rounding does not. `partial` holds kiln_stats_bytes(m, n, ...), `ref` n double2s.
struct BwdSumsError {
  double sum = 0, sum_gz = 0;
  bool ok() const { return sum <= 1e-4 && sum_gz <= 1e-4; }
};
inline BwdSumsError bwd_sums_error(const float* sums, const __half* z, const __half* g,
                                   const float* mean, int64_t m, int64_t n, int sm_count,
                                   void* partial, double2* ref, cudaStream_t s) {
  std::vector<float> hs(2 * static_cast<size_t>(n));
  PROBE_CUDA(cudaMemcpyAsync(hs.data(), sums, hs.size() * 4, cudaMemcpyDeviceToHost, s));
  PROBE_CUDA(kiln_bwd_sums(z, g, nullptr, nullptr, mean, m, n, sm_count, partial, s));
  PROBE_CUDA(kiln_stats_total(partial, m, n, sm_count, ref, s));
  std::vector<double2> href(static_cast<size_t>(n));
  PROBE_CUDA(
      cudaMemcpyAsync(href.data(), ref, href.size() * sizeof(double2), cudaMemcpyDeviceToHost, s));
  PROBE_CUDA(cudaStreamSynchronize(s));
  BwdSumsError e;
  const double scale = std::sqrt(static_cast<double>(m));
  for (int64_t j = 0; j < n; ++j) {
    e.sum = std::max(e.sum, std::fabs(hs[j] - href[j].x) / scale);
    e.sum_gz = std::max(e.sum_gz, std::fabs(hs[n + j] - href[j].y) / scale);
    if (!std::isfinite(hs[j]) || !std::isfinite(hs[n + j])) e.sum = e.sum_gz = INFINITY;
  }
  return e;
}

// dgrad_probe.cpp's comparison (kiln_cutlass_probe --dgrad); returns the exit code.
int dgrad_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop, int64_t batch,
                int reps, int max_engines, int64_t only, const std::string& shape);
// conv_probe.cpp's (kiln_cutlass_probe --conv): VGG16's and ResNet-50's 3x3 convolutions.
int conv_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop, int64_t batch,
               int reps, int max_engines, int64_t only, const std::string& shape);

// prologue_probe.cpp's (kiln_cutlass_probe --prologue): BatchNorm + ReLU on the 1x1 GEMM's load.
int prologue_probe(cudaStream_t s, const cudaDeviceProp& prop, int64_t batch, int reps,
                   int64_t only, const std::string& shape);
// --fold-dgrad (fold_dgrad_probe.cpp): BatchNorm's dx pass folded into the 1x1 data gradient
// (src/backend/cuda/fold_dgrad.h) against the dx pass then the SM90 data gradient.
int fold_dgrad_probe(cudaStream_t s, const cudaDeviceProp& prop, int64_t batch, int reps,
                     const std::string& shape);

// --first-layer (first_layer_probe.cpp): the first layer's direct convolution with BatchNorm's
// sums against cuDNN's forward and kiln's statistics pass.
int first_layer_probe(cudnnHandle_t handle, cudaStream_t s, const cudaDeviceProp& prop,
                      int64_t batch, int reps, int max_engines);

}  // namespace kiln::probe
