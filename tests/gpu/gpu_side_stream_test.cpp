// The side stream's join rule (src/backend/cuda/side_stream.h), on byte ranges alone: no GPU
// needed. A node waits for forked work that writes what it reads or writes, or that reads what
// it writes; two readers of the same bytes, or bytes of another region, need no join.
#include <gtest/gtest.h>

// The rule lives in the CUDA backend, which a CPU-only build (KILN_CUDA=OFF) does not have.
#if defined(KILN_HAVE_CUDA)
#include "backend/cuda/side_stream.h"

namespace kiln::cuda {
namespace {

ByteRange feat(int64_t begin, int64_t end) {
  return {Region::features, begin, end};
}

TEST(SideStreamJoin, WaitsOnlyWhereBytesAreShared) {
  // A weight gradient reading x [0, 100) and dz [200, 300) of the features, writing dw.
  const SideWork w{nullptr, {feat(0, 100), feat(200, 300)}, {{Region::grads_f32, 0, 64}}};
  EXPECT_FALSE(must_join(w, {feat(0, 100)}, {feat(300, 400)}))
      << "reads the same input, writes elsewhere";
  EXPECT_TRUE(must_join(w, {}, {feat(50, 60)})) << "overwrites the work's input (memory reuse)";
  EXPECT_TRUE(must_join(w, {}, {feat(299, 301)})) << "one byte of overlap is enough";
  EXPECT_FALSE(must_join(w, {}, {feat(100, 200)})) << "adjacent ranges do not overlap";
  EXPECT_TRUE(must_join(w, {{Region::grads_f32, 32, 40}}, {}))
      << "reads the gradient the work writes";
  EXPECT_TRUE(must_join(w, {}, {{Region::grads_f32, 0, 8}}))
      << "writes the gradient the work writes";
  EXPECT_FALSE(must_join(w, {{Region::params_f32, 0, 64}}, {{Region::params_f32, 0, 64}}))
      << "another region";
}

}  // namespace
}  // namespace kiln::cuda
#endif  // KILN_HAVE_CUDA
