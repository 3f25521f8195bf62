// The CUDA backend's environment switches (cuda_common.h's Options), read without a GPU: the
// defaults the H200 measurements chose, each switch's values, and one clear error naming the
// variable and its choices for a value it does not know.
#include <gtest/gtest.h>

// The options live in the CUDA backend, which a CPU-only build (KILN_CUDA=OFF) does not have.
#if defined(KILN_HAVE_CUDA)
#include <string>

#include "backend/cuda/cuda_common.h"
#include "kiln/core/error.h"
#include "support/scoped_env.h"

namespace kiln::cuda {
namespace {

using test::ScopedEnv;
using test::ScopedUnset;

TEST(CudaOptions, DefaultsAreTheMeasuredOnes) {
  const ScopedUnset a("KILN_FP32_WINOGRAD"), b("KILN_SIDE_WGRAD"), c("KILN_CBR_FORM"),
      d("KILN_TF32");
  const Options o = options_from_env();
  EXPECT_EQ(o.fp32_winograd, Fp32Winograd::allowed)
      << "FP32 Winograd/FFT: 1.52x on FP32 VGG16-BN, within 1e-5";
  EXPECT_FALSE(o.side_wgrad) << "side-stream weight gradients: no gain on the H200";
  EXPECT_FALSE(o.cbr_genstats) << "kiln's CBR form: the genstats form measured slower";
  EXPECT_FALSE(o.tf32) << "FP32 means FP32 unless --tf32";
}

TEST(CudaOptions, Fp32WinogradValues) {
  {
    ScopedEnv e("KILN_FP32_WINOGRAD", "0");
    EXPECT_EQ(options_from_env().fp32_winograd, Fp32Winograd::off);
  }
  {
    ScopedEnv e("KILN_FP32_WINOGRAD", "1");
    EXPECT_EQ(options_from_env().fp32_winograd, Fp32Winograd::allowed);
  }
  {
    ScopedEnv e("KILN_FP32_WINOGRAD", "only");
    EXPECT_EQ(options_from_env().fp32_winograd, Fp32Winograd::only);
  }
  {
    ScopedEnv e("KILN_FP32_WINOGRAD", "off");  // the words every switch takes
    EXPECT_EQ(options_from_env().fp32_winograd, Fp32Winograd::off);
  }
}

void expect_refused(const char* name, const char* value, const char* choices) {
  ScopedEnv e(name, value);
  try {
    options_from_env();
    ADD_FAILURE() << name << "=" << value << " was accepted";
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_EQ(err.kind(), ErrorKind::InvalidArgument) << what;
    EXPECT_NE(what.find(std::string(name) + "=" + value), std::string::npos) << what;
    EXPECT_NE(what.find(choices), std::string::npos) << what;
  }
}

TEST(CudaOptions, UnknownValuesAreOneClearError) {
  expect_refused("KILN_FP32_WINOGRAD", "sometimes",
                 "0 (no Winograd or FFT in FP32), 1 (allowed) or only");
  expect_refused("KILN_CBR_FORM", "mlperf", "use kiln (the default) or genstats");
}

}  // namespace
}  // namespace kiln::cuda
#endif  // KILN_HAVE_CUDA
