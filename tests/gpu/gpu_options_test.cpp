// The CUDA backend's switches (switches.def, as cuda_kernel.h's Options), made without a GPU:
// the defaults the H200 measurements chose, each switch's values, and one clear error naming
// the variable and its choices for a value it does not know.
#include <gtest/gtest.h>

// The options live in the CUDA backend, which a CPU-only build (KILN_CUDA=OFF) does not have.
#if defined(KILN_HAVE_CUDA)
#include <map>
#include <string>

#include "backend/cuda/cuda_kernel.h"
#include "kiln/core/error.h"

namespace kiln::cuda {
namespace {

// Options as a process with these variables (and no others) gets them.
Options options_with(const std::map<std::string, std::string>& vars) {
  auto get = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  return options_from_switches(Switches::parse(get, Switches{}));
}

TEST(CudaOptions, DefaultsAreTheMeasuredOnes) {
  const Options o = options_with({});
  EXPECT_EQ(o.fp32_winograd, Fp32Winograd::allowed)
      << "FP32 Winograd/FFT: 1.52x on FP32 VGG16-BN, within 1e-5";
  EXPECT_FALSE(o.side_wgrad) << "side-stream weight gradients: no gain on the H200";
  EXPECT_FALSE(o.cbr_genstats) << "kiln's CBR form: the genstats form measured slower";
  EXPECT_FALSE(o.tf32) << "FP32 means FP32 unless --tf32";
}

TEST(CudaOptions, Fp32WinogradValues) {
  EXPECT_EQ(options_with({{"KILN_FP32_WINOGRAD", "0"}}).fp32_winograd, Fp32Winograd::off);
  EXPECT_EQ(options_with({{"KILN_FP32_WINOGRAD", "1"}}).fp32_winograd, Fp32Winograd::allowed);
  EXPECT_EQ(options_with({{"KILN_FP32_WINOGRAD", "only"}}).fp32_winograd, Fp32Winograd::only);
  // the words every switch takes
  EXPECT_EQ(options_with({{"KILN_FP32_WINOGRAD", "off"}}).fp32_winograd, Fp32Winograd::off);
}

void expect_refused(const char* name, const char* value, const char* choices) {
  try {
    options_with({{name, value}});
    ADD_FAILURE() << name << "=" << value << " was accepted";
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_EQ(err.kind(), ErrorKind::InvalidArgument) << what;
    EXPECT_NE(what.find(std::string(name) + "=" + value), std::string::npos) << what;
    EXPECT_NE(what.find(choices), std::string::npos) << what;
  }
}

TEST(CudaOptions, UnknownValuesAreOneClearError) {
  expect_refused("KILN_FP32_WINOGRAD", "sometimes", "use one of 0|1|only");
  expect_refused("KILN_CBR_FORM", "mlperf", "use one of kiln|genstats");
}

// KILN_CUTLASS reaches the backend as Options::cutlass, which prepare() resolves for the device,
// the build and the program's precision (sm90_conv_gemm_tried; Sm90ConvRule.* checks that).
TEST(CudaOptions, CutlassSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).cutlass, Auto::automatic)
      << "auto: +3.15% on ResNet-50 AMP on the H200, and the golden steps pass with it on";
  EXPECT_EQ(options_with({{"KILN_CUTLASS", "auto"}}).cutlass, Auto::automatic);
  EXPECT_EQ(options_with({{"KILN_CUTLASS", "1"}}).cutlass, Auto::on);
  EXPECT_EQ(options_with({{"KILN_CUTLASS", "on"}}).cutlass, Auto::on);
  EXPECT_EQ(options_with({{"KILN_CUTLASS", "0"}}).cutlass, Auto::off);
  EXPECT_EQ(options_with({{"KILN_CUTLASS", "off"}}).cutlass, Auto::off);
  expect_refused("KILN_CUTLASS", "maybe", "use auto or");
}

// KILN_CUTLASS_DGRAD likewise reaches Options::cutlass_dgrad, which prepare() resolves after
// KILN_CUTLASS (sm90_dgrad_tried; DgradBnRule.* checks that).
TEST(CudaOptions, CutlassDgradSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).cutlass_dgrad, Auto::automatic);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_DGRAD", "auto"}}).cutlass_dgrad, Auto::automatic);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_DGRAD", "1"}}).cutlass_dgrad, Auto::on);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_DGRAD", "0"}}).cutlass_dgrad, Auto::off);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_DGRAD", "0"}}).cutlass, Auto::automatic);
  expect_refused("KILN_CUTLASS_DGRAD", "maybe", "use auto or");
}

// KILN_CUTLASS_CONV_DGRAD reaches Options::cutlass_conv_dgrad (resolved after
// KILN_CUTLASS_DGRAD: sm90_implicit_dgrad_tried), KILN_BN_FUSED_FINALIZE
// Options::bn_fused_finalize.
TEST(CudaOptions, ConvDgradAndFusedFinalizeSwitchesReachTheOptions) {
  EXPECT_EQ(options_with({}).cutlass_conv_dgrad, Auto::automatic);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_CONV_DGRAD", "1"}}).cutlass_conv_dgrad, Auto::on);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_CONV_DGRAD", "0"}}).cutlass_conv_dgrad, Auto::off);
  EXPECT_EQ(options_with({{"KILN_CUTLASS_CONV_DGRAD", "1"}}).cutlass_conv, Auto::automatic);
  expect_refused("KILN_CUTLASS_CONV_DGRAD", "maybe", "use auto or");
  EXPECT_FALSE(options_with({}).bn_fused_finalize) << "off: measured neutral";
  EXPECT_TRUE(options_with({{"KILN_BN_FUSED_FINALIZE", "1"}}).bn_fused_finalize);
  EXPECT_FALSE(options_with({{"KILN_BN_FUSED_FINALIZE", "0"}}).bn_fused_finalize);
}

// KILN_SUMS_CLEAR_KERNEL reaches Options::sums_clear_kernel.
TEST(CudaOptions, SumsClearKernelSwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).sums_clear_kernel) << "on by default since it ran on a GPU";
  EXPECT_TRUE(options_with({{"KILN_SUMS_CLEAR_KERNEL", "1"}}).sums_clear_kernel);
  EXPECT_FALSE(options_with({{"KILN_SUMS_CLEAR_KERNEL", "0"}}).sums_clear_kernel);
  expect_refused("KILN_SUMS_CLEAR_KERNEL", "maybe", "is not a switch value");
}

// KILN_RESIDUAL_BN_SUMS_IN_DX reaches Options::residual_bn_sums_in_dx.
TEST(CudaOptions, ResidualBnSumsInDxSwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).residual_bn_sums_in_dx) << "on by default";
  EXPECT_TRUE(options_with({{"KILN_RESIDUAL_BN_SUMS_IN_DX", "1"}}).residual_bn_sums_in_dx);
  EXPECT_FALSE(options_with({{"KILN_RESIDUAL_BN_SUMS_IN_DX", "0"}}).residual_bn_sums_in_dx);
  expect_refused("KILN_RESIDUAL_BN_SUMS_IN_DX", "maybe", "is not a switch value");
}

// KILN_STAGE_COPY_THREADS reaches Options::stage_copy_threads as a count (host_copy.h), and
// KILN_STAGE_IN_PIECES Options::stage_in_pieces.
TEST(CudaOptions, StagingSwitchesReachTheOptions) {
  EXPECT_GE(options_with({}).stage_copy_threads, 1) << "auto: at least one thread";
  EXPECT_EQ(options_with({{"KILN_STAGE_COPY_THREADS", "1"}}).stage_copy_threads, 1);
  EXPECT_EQ(options_with({{"KILN_STAGE_COPY_THREADS", "6"}}).stage_copy_threads, 6);
  expect_refused("KILN_STAGE_COPY_THREADS", "-1", "use 0 (auto) or a count");
  expect_refused("KILN_STAGE_COPY_THREADS", "many", "KILN_STAGE_COPY_THREADS");
  EXPECT_TRUE(options_with({}).stage_in_pieces) << "on by default";
  EXPECT_FALSE(options_with({{"KILN_STAGE_IN_PIECES", "0"}}).stage_in_pieces);
}

// KILN_BN_DEEP_LOADS reaches Options::bn_deep_loads.
TEST(CudaOptions, BnDeepLoadsSwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).bn_deep_loads) << "on by default since it ran on a GPU";
  EXPECT_FALSE(options_with({{"KILN_BN_DEEP_LOADS", "0"}}).bn_deep_loads);
  expect_refused("KILN_BN_DEEP_LOADS", "maybe", "is not a switch value");
}

// KILN_POOL_GROUP_APPLY reaches Options::pool_group_apply.
TEST(CudaOptions, PoolGroupApplySwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).pool_group_apply) << "on by default since it ran on a GPU";
  EXPECT_FALSE(options_with({{"KILN_POOL_GROUP_APPLY", "0"}}).pool_group_apply);
  expect_refused("KILN_POOL_GROUP_APPLY", "maybe", "is not a switch value");
}

// KILN_POOL_ROUTE_EAGER reaches Options::pool_route_eager.
TEST(CudaOptions, PoolRouteEagerSwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).pool_route_eager) << "on by default";
  EXPECT_FALSE(options_with({{"KILN_POOL_ROUTE_EAGER", "0"}}).pool_route_eager);
  expect_refused("KILN_POOL_ROUTE_EAGER", "maybe", "is not a switch value");
}

// KILN_PAD_INPUT_ONCE reaches Options::pad_input_once.
TEST(CudaOptions, PadInputOnceSwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).pad_input_once) << "on by default";
  EXPECT_FALSE(options_with({{"KILN_PAD_INPUT_ONCE", "0"}}).pad_input_once);
  expect_refused("KILN_PAD_INPUT_ONCE", "maybe", "is not a switch value");
}

// KILN_FIXED_CHANNELS_CONV reaches Options::fixed_channels_conv.
TEST(CudaOptions, FixedChannelsConvSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).fixed_channels_conv, Auto::off) << "off: cuDNN was faster";
  EXPECT_EQ(options_with({{"KILN_FIXED_CHANNELS_CONV", "1"}}).fixed_channels_conv, Auto::on);
  EXPECT_EQ(options_with({{"KILN_FIXED_CHANNELS_CONV", "auto"}}).fixed_channels_conv,
            Auto::automatic);
  expect_refused("KILN_FIXED_CHANNELS_CONV", "maybe", "use auto or");
}

// KILN_FIRST_LAYER_CONV reaches Options::first_layer_conv.
TEST(CudaOptions, FirstLayerConvSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).first_layer_conv, Auto::automatic) << "timed per layer by default";
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_CONV", "0"}}).first_layer_conv, Auto::off);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_CONV", "1"}}).first_layer_conv, Auto::on);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_CONV", "auto"}}).first_layer_conv, Auto::automatic);
  expect_refused("KILN_FIRST_LAYER_CONV", "maybe", "use auto or");
}

// KILN_FIRST_LAYER_WGRAD reaches Options::first_layer_wgrad.
TEST(CudaOptions, FirstLayerWgradSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).first_layer_wgrad, Auto::automatic) << "timed per layer by default";
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_WGRAD", "0"}}).first_layer_wgrad, Auto::off);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_WGRAD", "1"}}).first_layer_wgrad, Auto::on);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_WGRAD", "auto"}}).first_layer_wgrad, Auto::automatic);
  expect_refused("KILN_FIRST_LAYER_WGRAD", "maybe", "use auto or");
}

// KILN_FIRST_LAYER_BN_FOLD reaches Options::first_layer_bn_fold (which acts only with
// KILN_FIRST_LAYER_WGRAD on).
TEST(CudaOptions, FirstLayerBnFoldSwitchReachesTheOptions) {
  EXPECT_EQ(options_with({}).first_layer_bn_fold, Auto::automatic) << "timed per layer by default";
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_BN_FOLD", "0"}}).first_layer_bn_fold, Auto::off);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_BN_FOLD", "auto"}}).first_layer_bn_fold,
            Auto::automatic);
  EXPECT_EQ(options_with({{"KILN_FIRST_LAYER_BN_FOLD", "1"}}).first_layer_bn_fold, Auto::on);
  expect_refused("KILN_FIRST_LAYER_BN_FOLD", "maybe", "use auto or");
}

// KILN_DGRAD_NO_DY2 reaches Options::dgrad_no_dy2.
TEST(CudaOptions, DgradNoDy2SwitchReachesTheOptions) {
  EXPECT_TRUE(options_with({}).dgrad_no_dy2) << "on by default";
  EXPECT_FALSE(options_with({{"KILN_DGRAD_NO_DY2", "0"}}).dgrad_no_dy2);
  expect_refused("KILN_DGRAD_NO_DY2", "maybe", "is not a switch value");
}

// KILN_CONV_DGRAD_WIDE_TILE reaches Options::conv_dgrad_wide_tile.
TEST(CudaOptions, ConvDgradWideTileSwitchReachesTheOptions) {
  EXPECT_FALSE(options_with({}).conv_dgrad_wide_tile) << "off by default";
  EXPECT_TRUE(options_with({{"KILN_CONV_DGRAD_WIDE_TILE", "1"}}).conv_dgrad_wide_tile);
  expect_refused("KILN_CONV_DGRAD_WIDE_TILE", "maybe", "is not a switch value");
}

// KILN_CONV_DGRAD_PINGPONG reaches Options::conv_dgrad_pingpong.
TEST(CudaOptions, ConvDgradPingpongSwitchReachesTheOptions) {
  EXPECT_FALSE(options_with({}).conv_dgrad_pingpong) << "off by default";
  EXPECT_TRUE(options_with({{"KILN_CONV_DGRAD_PINGPONG", "1"}}).conv_dgrad_pingpong);
  expect_refused("KILN_CONV_DGRAD_PINGPONG", "maybe", "is not a switch value");
}

}  // namespace
}  // namespace kiln::cuda
#endif  // KILN_HAVE_CUDA
