// The CPU backend's kernel interface. One factory per op of ops.def, named make_<op>;
// each builds its oneDNN primitives (or loop state) once, at compile time, and run()
// executes it with no allocation.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>

#include "backend/node_checks.h"
#include "kiln/graph/program.h"

namespace kiln::cpu {

struct Context : ProgramView {
  Context() : ProgramView("CPU") {}
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::array<uint8_t*, kRegionCount> base{};

  template <typename T = float>
  T* ptr(TensorId id) const {
    const DTensor& t = program->tensor(id);
    return reinterpret_cast<T*>(base[static_cast<size_t>(t.region)] + t.offset);
  }
};

class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual void run(Context& ctx) = 0;
};
using KernelPtr = std::unique_ptr<Kernel>;

// Factories, one per op (defined across src/backend/cpu/*.cpp). A fused op the CPU does
// not run throws kiln::Error(Unsupported).
#define KILN_OP(name, category, doc) KernelPtr make_##name(const Node& node, Context& ctx);
#include "kiln/graph/ops.def"
#undef KILN_OP

// bn_fwd_train with its output written to dst (a buffer of x's size that no tensor holds:
// cbr_pool_fwd's full-resolution BatchNorm output) instead of node output 0.
KernelPtr make_bn_fwd_train_into(const Node& node, Context& ctx, float* dst);

// Whether the CPU backend runs the op (FP32 only).
bool cpu_supports(OpKind op);

}  // namespace kiln::cpu
