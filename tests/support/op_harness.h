// OpHarness: a Program of one phase built by hand, for testing single ops on a backend.
// Tensors are declared with their region, shape and dtype; nodes are appended; compile()
// places the memory (no reuse) and compiles the backend.
#pragma once
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kiln/backend/backend.h"
#include "kiln/core/rng.h"
#include "kiln/graph/memory_plan.h"
#include "kiln/graph/program.h"

namespace kiln::test {

class OpHarness {
 public:
  explicit OpHarness(bool amp = false) {
    program_.model = "op-test";
    program_.options.amp = amp;
    program_.options.memory_reuse = false;
    program_.feature_dtype = amp ? DType::F16 : DType::F32;
    program_.train.push_back(Phase{PhaseKind::forward_backward, "forward_backward", 0, {}});
  }

  TensorId tensor(const std::string& name, Shape shape, Region region = Region::features,
                  DType dtype = DType::F32, Layout layout = Layout::Flat) {
    DTensor t;
    t.id = static_cast<TensorId>(program_.tensors.size());
    t.name = name;
    t.region = region;
    t.shape = std::move(shape);
    t.dtype = dtype;
    t.layout = layout;
    if (is_param_region(region)) {
      // Parameter regions are slot-addressed: give each tensor its own slot.
      t.offset = param_cursor_ * static_cast<int64_t>(dtype_size(dtype));
      param_cursor_ += align_up(t.numel(), 128);
      program_.param_elems = param_cursor_;
    }
    program_.tensors.push_back(t);
    return t.id;
  }

  Node& node(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, Attrs attrs = {}) {
    Node n;
    n.op = op;
    n.in = std::move(in);
    n.out = std::move(out);
    n.attrs = attrs;
    n.label = op_name(op);
    program_.train.back().nodes.push_back(n);
    return program_.train.back().nodes.back();
  }

  // validate = false: for kernels whose tensors no whole program may hold (FP16 on the CPU).
  void compile(std::unique_ptr<Backend> backend, bool validate = true) {
    plan_memory(program_);
    if (validate) validate_program(program_);
    backend_ = std::move(backend);
    backend_->prepare(program_);
  }
  void run() { backend_->run(Schedule::train, 0); }

  void write(TensorId id, const std::vector<float>& v) {
    write_floats(*backend_, program_.tensor(id), v);
  }
  std::vector<float> read(TensorId id) { return read_floats(*backend_, program_.tensor(id)); }
  void write_i32(TensorId id, const std::vector<int32_t>& v) {
    backend_->write(program_.tensor(id), v.data());
  }
  std::vector<int32_t> read_i32(TensorId id) {
    std::vector<int32_t> v(static_cast<size_t>(program_.tensor(id).numel()));
    backend_->read(program_.tensor(id), v.data());
    return v;
  }
  void write_u8(TensorId id, const std::vector<uint8_t>& v) {
    backend_->write(program_.tensor(id), v.data());
  }
  std::vector<uint8_t> read_u8(TensorId id) {
    std::vector<uint8_t> v(static_cast<size_t>(program_.tensor(id).bytes()));
    backend_->read(program_.tensor(id), v.data());
    return v;
  }

  Program& program() { return program_; }
  Backend& backend() { return *backend_; }

  static bool is_param_region(Region r) {
    return r == Region::params_f32 || r == Region::params_f16 || r == Region::grads_f32 ||
           r == Region::grads_f16 || r == Region::moment1 || r == Region::moment2 ||
           r == Region::ema_f32 || r == Region::ema_f16;
  }

 private:
  Program program_;
  std::unique_ptr<Backend> backend_;
  int64_t param_cursor_ = 0;
};

// KILN_OP_TEST_ERRORS=1: the op tests print every measured error next to its bound (to see
// the margin). A test-only diagnostic, not a kiln switch.
inline bool print_op_errors() {
  static const bool on = std::getenv("KILN_OP_TEST_ERRORS") != nullptr;
  return on;
}

inline std::vector<float> random_values(size_t n, uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

// Largest |a-b| / max(|b|, floor) over the elements: a relative error that does not blow up
// at values near zero (floor is the scale below which absolute error is what matters).
inline double max_rel_error(const std::vector<float>& a, const std::vector<double>& b,
                            double floor = 1e-3) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double err =
        std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(std::fabs(b[i]), floor);
    worst = std::max(worst, err);
  }
  return worst;
}

}  // namespace kiln::test
