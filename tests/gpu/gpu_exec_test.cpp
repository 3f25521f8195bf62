// Execution on CUDA: a phase captured as a CUDA Graph gives the same bits as its nodes
// launched one by one (and on one stream as on three); an overflowed step changes no weight,
// moment or EMA and halves the loss scale, which never falls below 1; staged batches (A/B,
// pinned buffers, transfer stream) arrive intact in the step that uses them.
#include <gtest/gtest.h>

#include <limits>

#include "backend/cuda/cuda_backend.h"
#include "gpu/gpu_test_util.h"

namespace kiln::test {
namespace {

// A small network's forward, loss and a few backward ops, in one phase, FP32 or AMP.
struct Net {
  OpHarness h;
  TensorId x, w, y, bn_y, saved, gamma, beta, rm, rv, r, pool, am, g, fw, fb, logits, labels, scale,
      loss, correct, dz, dfx, dfw, dgap, dpool, drelu, dbn, dgamma, dbeta;
  explicit Net(bool amp) : h(amp) {
    const DType ft = amp ? DType::F16 : DType::F32;
    const Region wr = amp ? Region::params_f16 : Region::params_f32;
    const int64_t N = 8, H = 12, C = 8, K = 16, O = 10;
    x = h.tensor("x", {N, H, H, C}, Region::features, ft, Layout::NHWC);
    w = h.tensor("w", {K, 3, 3, C}, wr, ft, Layout::KRSC);
    y = h.tensor("y", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    gamma = h.tensor("gamma", {K}, Region::params_f32);
    beta = h.tensor("beta", {K}, Region::params_f32);
    rm = h.tensor("rm", {K}, Region::bn_running);
    rv = h.tensor("rv", {K}, Region::bn_running);
    bn_y = h.tensor("bn_y", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    saved = h.tensor("saved", {2, K}, Region::bn_saved);
    r = h.tensor("r", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    pool = h.tensor("pool", {N, H / 2, H / 2, K}, Region::features, ft, Layout::NHWC);
    am = h.tensor("am", {N, H / 2, H / 2, K}, Region::aux, DType::I32, Layout::NHWC);
    g = h.tensor("gap", {N, K}, Region::features, ft, Layout::NC);
    fw = h.tensor("fw", {O, K}, wr, ft, Layout::OI);
    fb = h.tensor("fb", {O}, Region::params_f32);
    logits = h.tensor("logits", {N, O}, Region::features, ft, Layout::NC);
    labels = h.tensor("labels", {N}, Region::aux, DType::I32);
    scale = h.tensor("loss_scale", {1}, Region::scalars);
    loss = h.tensor("loss", {1}, Region::scalars);
    correct = h.tensor("correct", {2}, Region::scalars, DType::I32);
    dz = h.tensor("dz", {N, O}, Region::features, ft, Layout::NC);
    dfx = h.tensor("dfx", {N, K}, Region::features, ft, Layout::NC);
    dfw = h.tensor("dfw", {O, K}, Region::grads_f32);
    dgap = h.tensor("dgap", {N, H / 2, H / 2, K}, Region::features, ft, Layout::NHWC);
    dpool = h.tensor("dpool", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    drelu = h.tensor("drelu", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    dbn = h.tensor("dbn", {N, H, H, K}, Region::features, ft, Layout::NHWC);
    dgamma = h.tensor("dgamma", {K}, Region::grads_f32);
    dbeta = h.tensor("dbeta", {K}, Region::grads_f32);
    Attrs conv;
    conv.kh = conv.kw = 3;
    conv.ph = conv.pw = 1;
    Attrs mp;
    mp.kh = mp.kw = mp.sh = mp.sw = 2;
    h.node(OpKind::conv_fwd, {x, w}, {y}, conv);
    h.node(OpKind::bn_fwd_train, {y, gamma, beta, rm, rv}, {bn_y, saved});
    h.node(OpKind::relu_fwd, {bn_y}, {r});
    h.node(OpKind::maxpool_fwd, {r}, {pool, am}, mp);
    h.node(OpKind::gap_fwd, {pool}, {g});
    h.node(OpKind::fc_fwd, {g, fw, fb}, {logits});
    h.node(OpKind::softmax_ce, {logits, labels, scale}, {loss, correct, dz});
    h.node(OpKind::fc_bwd_weight, {g, dz}, {dfw});
    h.node(OpKind::fc_bwd_data, {dz, fw}, {dfx});
    h.node(OpKind::gap_bwd, {dfx}, {dgap});
    h.node(OpKind::maxpool_bwd, {dgap, am}, {dpool}, mp);
    h.node(OpKind::relu_bwd, {r, dpool}, {drelu});
    h.node(OpKind::bn_bwd, {y, drelu, gamma, saved}, {dbn, dgamma, dbeta});
  }
  void init() {
    h.write(x, rand_floats(h.program().tensor(x).numel(), 1));
    h.write(w, rand_floats(h.program().tensor(w).numel(), 2, -0.3f, 0.3f));
    h.write(gamma, rand_floats(16, 3, 0.5f, 1.5f));
    h.write(beta, rand_floats(16, 4));
    h.write(rv, std::vector<float>(16, 1.0f));
    h.write(fw, rand_floats(160, 5));
    h.write(fb, rand_floats(10, 6));
    h.write_i32(labels, {0, 1, 2, 3, 4, 5, 6, 7});
    h.write(scale, {h.program().options.amp ? 1024.0f : 1.0f});
  }
  // Every output as raw bits (floats read back as floats; ints as ints).
  std::vector<std::vector<float>> outputs() {
    std::vector<std::vector<float>> v;
    for (TensorId id : {y, bn_y, saved, rm, rv, r, pool, g, logits, loss, dz, dfx, dfw, dgap, dpool,
                        drelu, dbn, dgamma, dbeta}) {
      v.push_back(h.read(id));
    }
    return v;
  }
};

std::vector<std::vector<float>> run_net(bool amp, const char* graphs, const char* streams,
                                        int runs) {
  Switches sw = Switches::from_environment();
  sw.set("cuda_graphs", graphs, "KILN_CUDA_GRAPHS");
  sw.set("streams", streams, "KILN_STREAMS");
  Net net(amp);
  net.h.compile(make_backend("cuda", sw));
  net.init();
  for (int i = 0; i < runs; ++i) net.h.run();
  return net.outputs();
}

class GpuExec : public ::testing::TestWithParam<bool> {};

TEST_P(GpuExec, CapturedPhaseEqualsNodeByNode) {
  KILN_REQUIRE_GPU();
  const bool amp = GetParam();
  // Three runs: the first launches node by node, the second captures, the third replays.
  const auto eager = run_net(amp, "0", "3", 3);
  const auto graph = run_net(amp, "1", "3", 3);
  const auto one_stream = run_net(amp, "1", "1", 3);
  ASSERT_EQ(eager.size(), graph.size());
  for (size_t i = 0; i < eager.size(); ++i) {
    // wgrad / matmul engines may split their sums differently run to run only when they use
    // atomics; the ops here are deterministic, so the bits must agree.
    EXPECT_EQ(max_ulp(graph[i], eager[i]), 0)
        << "output " << i << " differs between graph replay and eager";
    EXPECT_EQ(max_ulp(one_stream[i], eager[i]), 0)
        << "output " << i << " differs with KILN_STREAMS=1";
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuExec, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "amp" : "fp32";
                         });

// The update half of an AMP step, as the compiler schedules it: check_scale, optimizer,
// ema and weight_cast phases on the update stream.
TEST(GpuExecOverflow, InjectedInfSkipsTheStepAndHalvesTheScale) {
  KILN_REQUIRE_GPU();
  OpHarness h(/*amp=*/true);
  Program& p = h.program();
  p.train.clear();
  const int64_t n = 1000;
  const TensorId w = h.tensor("w", {n}, Region::params_f32),
                 g = h.tensor("g", {n}, Region::grads_f32);
  const TensorId m = h.tensor("m", {n}, Region::moment1), e = h.tensor("ema", {n}, Region::ema_f32);
  const TensorId w16 = h.tensor("w16", {n}, Region::params_f16, DType::F16);
  const TensorId lr = h.tensor("lr", {1}, Region::scalars),
                 scale = h.tensor("loss_scale", {1}, Region::scalars);
  const TensorId ov = h.tensor("overflow", {1}, Region::scalars, DType::I32);
  const TensorId good = h.tensor("good_steps", {1}, Region::scalars, DType::I32);
  Attrs a;
  a.momentum = 0.9f;
  a.ema_decay = 0.9f;
  a.growth_interval = 1000;
  a.clip = 1.0f;
  p.train.push_back(Phase{PhaseKind::check_scale, "check_scale", 1, {}});
  h.node(OpKind::check_clip, {g, scale}, {ov, g}, a);
  h.node(OpKind::loss_scale_update, {ov, scale, good}, {scale, good}, a);
  p.train.push_back(Phase{PhaseKind::optimizer, "optimizer", 1, {}});
  h.node(OpKind::sgd, {w, g, m, lr, scale, ov}, {w, m}, a);
  p.train.push_back(Phase{PhaseKind::ema, "ema", 1, {}});
  h.node(OpKind::ema, {w, ov}, {e}, a);
  p.train.push_back(Phase{PhaseKind::weight_cast, "weight_cast", 1, {}});
  h.node(OpKind::cast, {w}, {w16});
  h.compile(make_backend("cuda"));

  const auto w0 = rand_floats(n, 1), m0 = rand_floats(n, 2), e0 = rand_floats(n, 3);
  h.write(w, w0);
  h.write(m, m0);
  h.write(e, e0);
  h.write(lr, {0.1f});
  h.write(scale, {8192.0f});
  auto bad = rand_floats(n, 4);
  bad[17] = std::numeric_limits<float>::infinity();
  bad[18] = std::numeric_limits<float>::quiet_NaN();
  h.write(g, bad);
  h.run();
  EXPECT_EQ(h.read_i32(ov)[0], 1);
  EXPECT_EQ(h.read(scale)[0], 4096.0f) << "the scale halves on overflow";
  EXPECT_EQ(max_ulp(h.read(w), w0), 0) << "an overflowed step changed the weights";
  EXPECT_EQ(max_ulp(h.read(m), m0), 0) << "an overflowed step changed the momentum";
  EXPECT_EQ(max_ulp(h.read(e), e0), 0) << "an overflowed step changed the EMA";

  for (int i = 0; i < 100; ++i) {
    h.write(g, bad);
    h.run();
  }
  EXPECT_EQ(h.read(scale)[0], 1.0f) << "100 overflows: the scale stops at its floor of 1";
  EXPECT_EQ(max_ulp(h.read(w), w0), 0);

  // A clean step trains again: weights move, the compute copy follows them.
  h.write(g, rand_floats(n, 5));
  h.run();
  EXPECT_EQ(h.read_i32(ov)[0], 0);
  const auto w1 = h.read(w);
  EXPECT_GT(max_ulp(w1, w0), 0) << "a clean step after overflows must update the weights";
  const auto w16v = h.read(w16);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(w16v[static_cast<size_t>(i)],
              half_to_float(float_to_half(w1[static_cast<size_t>(i)])));
  }
}

// Staged batches through transfer_a / transfer_b on the transfer stream, overlapping runs.
TEST(GpuExecStaging, BatchesArriveInTheStepThatUsesThem) {
  KILN_REQUIRE_GPU();
  OpHarness h(/*amp=*/true);
  Program& p = h.program();
  p.train.clear();
  const int64_t N = 4, H = 5, C = 3;
  for (int s = 0; s < 2; ++s) {
    const Region r = s == 0 ? Region::input_a : Region::input_b;
    p.io.staged_images[static_cast<size_t>(s)] =
        h.tensor(s == 0 ? "img_a" : "img_b", {N * H * H * C}, r);
    p.io.staged_labels[static_cast<size_t>(s)] =
        h.tensor(s == 0 ? "lab_a" : "lab_b", {N}, r, DType::I32);
  }
  const TensorId input = h.tensor("input", {N * H * H * C}, Region::features, DType::F16);
  const TensorId labels = h.tensor("labels", {N}, Region::aux, DType::I32);
  const TensorId sum = h.tensor("sum", {N * H * H * C}, Region::features, DType::F16);
  for (int s = 0; s < 2; ++s) {
    p.train.push_back(Phase{PhaseKind::transfer, s == 0 ? "transfer_a" : "transfer_b", 2, {}});
    h.node(OpKind::cast, {p.io.staged_images[static_cast<size_t>(s)]}, {input});
    h.node(OpKind::copy, {p.io.staged_labels[static_cast<size_t>(s)]}, {labels});
  }
  p.train.push_back(Phase{PhaseKind::forward_backward, "forward_backward", 0, {}});
  h.node(OpKind::add, {input, input}, {sum});
  h.compile(make_backend("cuda"));
  for (int step = 0; step < 6; ++step) {
    const int slot = step % 2;
    auto img = round_f16(rand_floats(N * H * H * C, 100 + static_cast<uint64_t>(step)));
    std::vector<int32_t> lab{step, step + 1, step + 2, step + 3};
    h.backend().stage_batch(slot, img.data(), lab.data());
    h.backend().run(Schedule::train, slot);
    const auto got = h.read(sum);
    for (size_t i = 0; i < img.size(); ++i)
      ASSERT_EQ(got[i], 2.0f * img[i]) << "step " << step << " element " << i;
    EXPECT_EQ(h.read_i32(labels), lab);
  }
  // Profiling: one time per phase run (transfer of the slot, then the compute phase).
  auto* api = dynamic_cast<CudaBackendApi*>(&h.backend());
  ASSERT_NE(api, nullptr);
  h.backend().set_profiling(true);
  h.backend().run(Schedule::train, 0);
  const auto times = api->phase_times();
  ASSERT_EQ(times.size(), 2u);
  EXPECT_EQ(times[0].first, "transfer_a");
  EXPECT_GE(times[1].second, 0.0f);
  h.backend().run(Schedule::train, 1);
  const std::string report = h.backend().profile_report();
  EXPECT_NE(report.find("transfer_b"), std::string::npos) << report;
  EXPECT_NE(report.find("over 2 runs"), std::string::npos) << report;
}

}  // namespace
}  // namespace kiln::test
