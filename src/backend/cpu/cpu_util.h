// Helpers shared by the CPU kernels (src/backend/cpu/*.cpp): oneDNN memory descriptors over
// kiln's layouts, a scratchpad shared by every primitive of one backend, and scalar reads of
// the device scalars. The node checks are both backends' (backend/node_checks.h).
#pragma once
#include <cstdint>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/cpu/cpu_kernel.h"
#include "kiln/core/error.h"

namespace kiln::cpu {

using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

// oneDNN's dims of an NHWC map (N, C, H, W order; the memory tag gives the layout).
inline dims nchw(const Nhwc& s) {
  return {s.n, s.c, s.h, s.w};
}

// oneDNN memory over a kiln tensor (fixed address: the region buffers never move).
dnnl::memory make_memory(Context& ctx, TensorId id, const dims& d, tag t);
// A memory over a buffer the kernel owns.
dnnl::memory make_memory(Context& ctx, void* p, const dims& d, tag t);

// A page-aligned host buffer, allocated at compile time (reserve() grows it; the old
// contents are not kept).
class Buffer {
 public:
  void reserve(size_t bytes);
  void* data() const { return p_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> p_;
  size_t size_ = 0;
};

// The scratchpad that every primitive of one backend (one Context) shares: kernels run
// one at a time on one stream (the CPU executor runs phases in order), so one buffer sized
// for the largest primitive is enough. Primitives are built with scratchpad_mode::user, so
// oneDNN allocates nothing in run().
std::shared_ptr<Buffer> scratchpad_for(const Context& ctx);

// primitive_attr with scratchpad_mode::user.
dnnl::primitive_attr user_scratchpad_attr();

// A prepared oneDNN primitive: its arguments are bound once; run() points the scratchpad
// argument at the shared buffer (which may have grown since) and executes.
class DnnlCall {
 public:
  DnnlCall() = default;
  DnnlCall(const Node& n, Context& ctx, dnnl::primitive prim, const dnnl::primitive_desc_base& pd,
           std::unordered_map<int, dnnl::memory> args);
  void operator()(Context& ctx);

 private:
  dnnl::primitive prim_;
  std::unordered_map<int, dnnl::memory> args_;
  std::shared_ptr<Buffer> scratch_;
  dnnl::memory scratch_mem_;
  bool has_scratch_ = false;
  std::string what_;  // "conv_fwd node 'layer1.0.conv1 fwd'", for errors
};

// A kernel that is one oneDNN primitive.
class DnnlKernel final : public Kernel {
 public:
  explicit DnnlKernel(DnnlCall call) : call_(std::move(call)) {}
  void run(Context& ctx) override { call_(ctx); }

 private:
  DnnlCall call_;
};

// Several primitives run in order (a weight reorder, then the convolution), with the
// buffers they use in between.
class DnnlSeqKernel final : public Kernel {
 public:
  DnnlSeqKernel(std::vector<DnnlCall> calls, std::vector<std::unique_ptr<Buffer>> buffers)
      : calls_(std::move(calls)), buffers_(std::move(buffers)) {}
  void run(Context& ctx) override {
    for (DnnlCall& c : calls_) c(ctx);
  }

 private:
  std::vector<DnnlCall> calls_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

// Rethrows a oneDNN failure while building a node's primitive as kiln::Error(Backend).
[[noreturn]] void rethrow_dnnl(const Node& n, const dnnl::error& e);

// Device scalars: f32, i32 or i64 tensors of one element, read and written as double.
// An absent tensor (kNoTensor) reads as `absent`.
double read_scalar(const Context& ctx, TensorId id, double absent);
void write_scalar(const Context& ctx, TensorId id, double v);
void expect_scalar(const Context& ctx, const Node& n, TensorId id, const char* role);

// Loop kernels wrap a lambda: make_loop([=](Context& ctx) {...}).
template <typename F>
class LoopKernel final : public Kernel {
 public:
  explicit LoopKernel(F f) : f_(std::move(f)) {}
  void run(Context& ctx) override { f_(ctx); }

 private:
  F f_;
};
template <typename F>
KernelPtr make_loop(F f) {
  return std::make_unique<LoopKernel<F>>(std::move(f));
}

}  // namespace kiln::cpu
