// The optimizers' [w16] output (ops.def; KILN_FUSE_WEIGHT_CAST) on one backend: SGD, AdamW and
// LARS, each with an FP16 and a BF16 compute copy, over three applied steps and a skipped one.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kiln/core/dtype.h"
#include "support/op_harness.h"

namespace kiln::test {

// After every applied step w16 holds exactly the cast op's rounding of the new w
// (float_to_half / float_to_bf16, which both backends' cast kernels match bit for bit); w and
// the moments are the bits the same node without w16 makes beside it; a skipped step leaves
// w16 as it was (it already held the unchanged w's copy). The harness is not validated: no
// whole CPU program holds FP16 tensors.
template <typename T>
int64_t count_differing(const std::vector<T>& a, const std::vector<T>& b) {
  int64_t bad = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    bad += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return bad;
}

inline void expect_optimizers_write_compute_copy(const std::string& backend) {
  for (OpKind op : {OpKind::sgd, OpKind::adamw, OpKind::lars}) {
    for (DType dt : {DType::F16, DType::BF16}) {
      SCOPED_TRACE(::testing::Message() << backend << " " << op_name(op) << " " << dtype_name(dt));
      const int64_t n = 100003;  // odd: every tail of a vectorised kernel
      const float scale = 1024.0f;
      OpHarness h(/*amp=*/backend != "cpu");
      const TensorId lr = h.tensor("lr", {1}, Region::scalars);
      const TensorId loss_scale = h.tensor("loss_scale", {1}, Region::scalars);
      const TensorId overflow = h.tensor("overflow", {1}, Region::scalars, DType::I32);
      const TensorId steps = h.tensor("step", {1}, Region::scalars, DType::I32);
      const TensorId g = h.tensor("g", {n}, Region::grads_f32);
      const TensorId w16 = h.tensor("w16", {n}, Region::params_f16, dt);
      Attrs a;
      a.momentum = 0.9f;
      a.weight_decay = 1e-2f;
      TensorId w[2], m[2];
      for (int k = 0; k < 2; ++k) {  // k = 1: with the compute copy
        const std::string tag = k ? " fused" : " plain";
        w[k] = h.tensor("w" + tag, {n}, Region::params_f32);
        m[k] = h.tensor("m" + tag, {n}, Region::moment1);
        const TensorId copy = k ? w16 : kNoTensor;
        if (op == OpKind::adamw) {
          const TensorId v = h.tensor("v" + tag, {n}, Region::moment2);
          h.node(op, {w[k], g, m[k], v, lr, loss_scale, overflow, steps}, {w[k], m[k], v, copy}, a);
        } else {
          h.node(op, {w[k], g, m[k], lr, loss_scale, overflow}, {w[k], m[k], copy}, a);
        }
      }
      h.compile(make_backend(backend), /*validate=*/false);
      const std::vector<float> w0 = random_values(static_cast<size_t>(n), 171, -2.0f, 2.0f);
      h.write(w[0], w0);
      h.write(w[1], w0);
      auto copy_bits = [&] {
        std::vector<uint16_t> b(static_cast<size_t>(n));
        h.backend().read(h.program().tensor(w16), b.data());
        return b;
      };
      auto cast_bits = [&](const std::vector<float>& v) {
        std::vector<uint16_t> b(v.size());
        for (size_t i = 0; i < v.size(); ++i)
          b[i] = dt == DType::F16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
        return b;
      };
      auto set_step = [&](int step, bool skip) {
        h.write(g, random_values(static_cast<size_t>(n), 172 + static_cast<uint64_t>(step), -scale,
                                 scale));
        h.write(lr, {0.05f});
        h.write(loss_scale, {scale});
        h.write_i32(overflow, {skip ? 1 : 0});
        h.write_i32(steps, {step});
      };
      for (int step = 0; step < 3; ++step) {
        set_step(step, false);
        h.run();
        const std::vector<float> now = h.read(w[1]);
        EXPECT_EQ(count_differing(now, h.read(w[0])), 0)
            << "step " << step << ": w with and without the copy";
        EXPECT_EQ(count_differing(h.read(m[1]), h.read(m[0])), 0) << "step " << step << ": m";
        EXPECT_EQ(count_differing(copy_bits(), cast_bits(now)), 0)
            << "step " << step << ": w16 against the cast of w";
      }
      const std::vector<uint16_t> before = copy_bits();
      set_step(3, true);
      h.run();
      EXPECT_EQ(count_differing(copy_bits(), before), 0)
          << "a skipped step leaves the compute copy";
    }
  }
}

}  // namespace kiln::test
