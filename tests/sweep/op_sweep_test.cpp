// The op x backend sweep: every OpKind of ops.def has rows here (a few shapes, the attributes,
// a tolerance and its reason), and every row runs on every backend - the CPU against the
// float64 reference (tests/support/reference.h), CUDA against the CPU on the same inputs in
// FP32 and under AMP (ctest label `gpu`, skipped without a GPU). The fused ops are checked
// against their unfused chain on each backend (tests/support/fused_checks.h). A row may
// instead name the test that covers its op (the collectives, which need several ranks).
//
// Adding an op: write KILN_SWEEP(name) with its rows in the rows_*.inc of its family; an op
// without one does not compile (sweep_cases' static_assert, instantiated for every op of the
// X-macro in sweep() below).
// KILN_OP_TEST_ERRORS=1 prints every measured error next to its bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "support/fused_checks.h"
#include "support/op_harness.h"
#include "support/reference.h"

namespace kiln::test {
namespace {

using ref::Vec;
using Values = std::map<std::string, Vec>;

// The rows, by op family, in this order (each file is part of this translation unit: the
// explicit specialisations of sweep_cases must all be seen by sweep() below, and later files use
// earlier ones' helpers).
// clang-format off
#include "sweep/sweep_rows.inc"
#include "sweep/rows_conv_bn.inc"
#include "sweep/rows_elementwise_pool_fc.inc"
#include "sweep/rows_loss_region_optim.inc"
#include "sweep/rows_fused.inc"
// clang-format on
#undef KILN_SWEEP

// ---- the table: every op of ops.def, in its order -----------------------------------------------

const std::vector<Case>& sweep() {
  static const std::vector<Case> all = [] {
    std::vector<Case> rows;
#define KILN_OP(name, category, doc) \
  for (Case c : sweep_cases<OpKind::name>()) rows.push_back(std::move(c));
#include "kiln/graph/ops.def"
#undef KILN_OP
    // kiln's CUDA kernels with 16-byte forms (channels in vectors of 8 f16 / 4 f32)
    const std::set<OpKind> vector_ops = {
        OpKind::bn_fwd_train, OpKind::bn_fwd_infer, OpKind::bn_bwd,      OpKind::relu_fwd,
        OpKind::relu_bwd,     OpKind::add,          OpKind::dropout_fwd, OpKind::dropout_bwd,
        OpKind::maxpool_fwd,  OpKind::maxpool_bwd,  OpKind::avgpool_fwd, OpKind::avgpool_bwd,
        OpKind::gap_fwd,      OpKind::gap_bwd};
    for (Case& c : rows) c.vector_variants = vector_ops.count(c.op) > 0;
    return rows;
  }();
  return all;
}

std::string test_name(const Case& c) {
  std::string s;  // gtest's names: letters, digits and single underscores
  for (const char ch : std::string(op_name(c.op)) + "_" + c.label) {
    const bool keep = std::isalnum(static_cast<unsigned char>(ch)) != 0;
    if (keep || (!s.empty() && s.back() != '_')) s += keep ? ch : '_';
  }
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}
std::string where(const Case& c) {
  return std::string(op_name(c.op)) + " " + c.label;
}

// ---- building and running a row on a backend ---------------------------------------------------

// The tensor of spec s on one side (gpu_test_util.h's Pair::add, with the dtype override).
TensorId declare(OpHarness& h, const Spec& s, bool amp) {
  DType d = s.dtype;
  Region r = s.region;
  Layout l = s.shape.rank() == 4 && !s.flat ? Layout::NHWC : Layout::Flat;
  switch (s.kind) {
    case Kind::Feature:
      d = amp ? DType::F16 : DType::F32, r = Region::features;
      break;
    case Kind::Weight:
      d = amp ? DType::F16 : DType::F32, r = amp ? Region::params_f16 : Region::params_f32;
      l = s.shape.rank() == 4 ? Layout::KRSC : Layout::OI;
      break;
    case Kind::WeightGrad:
      d = amp ? DType::F16 : DType::F32, r = amp ? Region::grads_f16 : Region::grads_f32;
      l = s.shape.rank() == 4 ? Layout::KRSC : Layout::OI;
      break;
    case Kind::F32:
      break;
    case Kind::I32:
      d = DType::I32, r = r == Region::features ? Region::aux : r;
      break;
    case Kind::U8:
      d = DType::U8, r = r == Region::features ? Region::aux : r;
      break;
  }
  return h.tensor(s.name, s.shape, r, d, l);
}

struct Built {
  OpHarness h;
  std::map<std::string, TensorId> id;
  explicit Built(bool amp) : h(amp) {}
};

void build(Built& b, const Case& c, bool amp, const char* backend, const Switches& sw) {
  for (const Spec& s : c.t) b.id[s.name] = declare(b.h, s, amp);
  auto ids = [&](const std::vector<std::string>& names) {
    std::vector<TensorId> v;
    for (const std::string& n : names) v.push_back(n.empty() ? kNoTensor : b.id.at(n));
    return v;
  };
  b.h.node(c.op, ids(c.in), ids(c.out), c.a).label = where(c);
  b.h.compile(make_backend(backend, sw), c.validate);
}

Values initial_values(const Case& c) {
  Values v;
  uint64_t seed = 1;
  for (const Spec& s : c.t) {
    const bool integer = s.kind == Kind::I32 || s.kind == Kind::U8;
    v[s.name] = integer ? Vec(static_cast<size_t>(s.shape.numel()), 0.0)
                        : rand_values_d(s.shape.numel(), seed, s.lo, s.hi);
    ++seed;
  }
  if (c.prepare) c.prepare(v);
  return v;
}

void write(Built& b, const std::string& name, const Vec& v) {
  const TensorId id = b.id.at(name);
  switch (b.h.program().tensor(id).dtype) {
    case DType::I32:
      b.h.write_i32(id, ints(v));
      break;
    case DType::U8:
      b.h.write_u8(id, std::vector<uint8_t>(v.begin(), v.end()));
      break;
    default:
      b.h.write(id, ref::to_float(v));
      break;
  }
}
Vec read(Built& b, const std::string& name) {
  const TensorId id = b.id.at(name);
  switch (b.h.program().tensor(id).dtype) {
    case DType::I32: {
      const std::vector<int32_t> i = b.h.read_i32(id);
      return Vec(i.begin(), i.end());
    }
    case DType::U8: {
      const std::vector<uint8_t> u = b.h.read_u8(id);
      return Vec(u.begin(), u.end());
    }
    default:
      return ref::to_double(b.h.read(id));
  }
}

bool same(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

// The worst element of got against want, named by op, shape, tensor and index.
void expect_check(const Case& c, const Check& k, const Vec& got) {
  ASSERT_EQ(got.size(), k.want.size()) << where(c) << ": " << k.tensor;
  double worst = 0;
  size_t at = 0, differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = 0;
    if (k.mag.empty()) {
      e = same(got[i], k.want[i]) ? 0.0 : std::numeric_limits<double>::infinity();
    } else {
      e = std::fabs(got[i] - k.want[i]) / std::max(k.mag[i], 1e-30);
      if (std::isnan(e))
        e = same(got[i], k.want[i]) ? 0.0 : std::numeric_limits<double>::infinity();
    }
    differ += e > k.tol;
    if (e > worst) worst = e, at = i;
  }
  if (print_op_errors())
    std::printf("  %-60s %-10s error %9.3g  bound %9.3g\n", where(c).c_str(), k.tensor.c_str(),
                worst, k.tol);
  EXPECT_EQ(differ, 0u) << where(c) << ": " << k.tensor << " " << differ << " of " << got.size()
                        << " elements beyond " << k.tol << " (" << k.why << "); worst element "
                        << at << ": got " << got[at] << ", want " << k.want[at] << " (error "
                        << worst << ")";
}

// CUDA's value against the CPU's: rel_error's measure (gpu_test_util.h), NaN equal to NaN,
// integers exact; the worst element named.
void expect_close(const Case& c, const Check& k, const Vec& gpu, const Vec& cpu, bool integer,
                  bool amp) {
  ASSERT_EQ(gpu.size(), cpu.size()) << where(c) << ": " << k.tensor;
  const double tol = integer ? 0.0 : amp ? kGpuAmpTol : kGpuFp32Tol;
  const bool sum = k.floor == Floor::sum || (amp && k.floor == Floor::sum_under_amp);
  double mx = 0;
  for (double w : cpu)
    if (std::isfinite(w)) mx = std::max(mx, std::fabs(w));
  const double f = std::max((sum ? kSumFloor : kEltFloor) * mx, 1e-30);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    double e =
        same(gpu[i], cpu[i]) ? 0.0 : std::fabs(gpu[i] - cpu[i]) / std::max(std::fabs(cpu[i]), f);
    if (std::isnan(e) || (integer && e > 0)) e = std::numeric_limits<double>::infinity();
    if (e > worst) worst = e, at = i;
  }
  if (print_op_errors())
    std::printf("  %-60s %-10s error %9.3g  bound %9.3g\n", where(c).c_str(), k.tensor.c_str(),
                worst, tol);
  EXPECT_LE(worst, tol) << where(c) << (amp ? " (AMP)" : " (FP32)") << ": " << k.tensor
                        << " element " << at << ": CUDA " << gpu[at] << ", CPU " << cpu[at]
                        << " (error " << worst << " > " << tol << ")";
}

// ---- the tests ----------------------------------------------------------------------------------

std::vector<size_t> rows_where(const std::function<bool(const Case&)>& keep) {
  std::vector<size_t> v;
  for (size_t i = 0; i < sweep().size(); ++i)
    if (keep(sweep()[i])) v.push_back(i);
  return v;
}

class SweepCpu : public ::testing::TestWithParam<size_t> {};

TEST_P(SweepCpu, MatchesFloat64Reference) {
  const Case& c = sweep()[GetParam()];
  if (c.chain) return c.chain("cpu", false, Switches::from_environment());
  Built b(false);
  build(b, c, false, "cpu", Switches::from_environment());
  const Values v = initial_values(c);
  for (const Spec& s : c.t) write(b, s.name, v.at(s.name));
  b.h.run();
  for (const Check& k : c.expect(v)) expect_check(c, k, read(b, k.tensor));
}

INSTANTIATE_TEST_SUITE_P(Ops, SweepCpu, ::testing::ValuesIn(rows_where([](const Case& c) {
                           return c.chain || !c.t.empty();
                         })),
                         [](const auto& info) { return test_name(sweep()[info.param]); });

// One row on CUDA and on the CPU, fed the same inputs (rounded to FP16 where CUDA's tensor is).
void cuda_against_cpu(const Case& c, bool amp, Switches sw) {
  if (c.chain) {
    sw.deterministic = true;
    return c.chain("cuda", amp, sw);
  }
  Built cpu(false), gpu(amp);
  build(cpu, c, false, "cpu", Switches::from_environment());
  build(gpu, c, amp, "cuda", sw);
  Values v = initial_values(c);
  for (const Spec& s : c.t) {
    Vec& x = v.at(s.name);
    if (gpu.h.program().tensor(gpu.id.at(s.name)).dtype == DType::F16 &&
        cpu.h.program().tensor(cpu.id.at(s.name)).dtype == DType::F32)
      for (double& e : x) e = half_to_float(float_to_half(static_cast<float>(e)));
    write(cpu, s.name, x);
    write(gpu, s.name, x);
  }
  cpu.h.run();
  gpu.h.run();
  for (const Check& k : c.expect(v)) {
    const DType d = gpu.h.program().tensor(gpu.id.at(k.tensor)).dtype;
    expect_close(c, k, read(gpu, k.tensor), read(cpu, k.tensor), d == DType::I32 || d == DType::U8,
                 amp);
  }
}

struct CudaRun {
  size_t row;
  bool amp;
};
void PrintTo(const CudaRun& r, std::ostream* os) {
  *os << where(sweep()[r.row]) << (r.amp ? " AMP" : " FP32");
}

class SweepCuda : public ::testing::TestWithParam<CudaRun> {};

TEST_P(SweepCuda, MatchesCpu) {
  KILN_REQUIRE_GPU();
  const Case& c = sweep()[GetParam().row];
  Switches sw = Switches::from_environment();
  if (!c.vector_variants) return cuda_against_cpu(c, GetParam().amp, sw);
  for (const bool vec : {true, false}) {
    SCOPED_TRACE(vec ? "16-byte kernels on" : "16-byte kernels off");
    sw.vector_kernels = vec;
    cuda_against_cpu(c, GetParam().amp, sw);
  }
}

std::vector<CudaRun> cuda_runs() {
  std::vector<CudaRun> runs;
  for (size_t i = 0; i < sweep().size(); ++i) {
    const Case& c = sweep()[i];
    if (!c.chain && c.t.empty()) continue;  // covered elsewhere
    if (c.fp32) runs.push_back({i, false});
    if (c.amp) runs.push_back({i, true});
  }
  return runs;
}

INSTANTIATE_TEST_SUITE_P(Ops, SweepCuda, ::testing::ValuesIn(cuda_runs()), [](const auto& info) {
  return test_name(sweep()[info.param.row]) + (info.param.amp ? "_amp" : "_fp32");
});

// Every op has rows of its own kind, with unique names; a row that runs nothing names its cover.
TEST(SweepTable, EveryOpHasRows) {
  std::set<std::string> names;
  std::vector<int> rows(kOpCount, 0);
  for (const Case& c : sweep()) {
    ++rows[static_cast<int>(c.op)];
    EXPECT_TRUE(names.insert(test_name(c)).second) << "two rows named " << test_name(c);
    const bool runs = c.chain || !c.t.empty();
    EXPECT_TRUE(runs || !c.covered_by.empty()) << where(c) << " runs nothing and names no cover";
    if (!c.chain && !c.t.empty()) EXPECT_TRUE(c.expect) << where(c) << " has no reference";
  }
  for (int i = 0; i < kOpCount; ++i) EXPECT_GT(rows[i], 0) << op_name(static_cast<OpKind>(i));
}

}  // namespace
}  // namespace kiln::test
