// A rank that dies, hangs or fails must not leave the others waiting: run only by the ctest
// fault cases (KILN_TEST_FAULT set; see CMakeLists.txt), under mpirun -np 2 with a short
// KILN_DIST_TIMEOUT. Rank 1 misbehaves before a collective that rank 0 enters; the job must
// end quickly with a non-zero status (the driver script checks the time and the message).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "kiln/core/error.h"
#include "kiln/process_group/process_group.h"

namespace kiln {
namespace {

TEST(DistFault, RankOneMisbehaves) {
  const char* fault = std::getenv("KILN_TEST_FAULT");
  if (!fault || dist::world() < 2)
    GTEST_SKIP() << "only for the fault cases (KILN_TEST_FAULT, mpirun -np 2)";
  const std::string f = fault;
  if (dist::rank() == 1) {
    if (f == "exit") std::_Exit(5);  // dies without a word
    if (f == "hang") std::this_thread::sleep_for(std::chrono::seconds(120));
    if (f == "error") {
      // What `kiln train` does when a rank meets an error: the guard notes it, main() prints
      // it and returns 2, and the exit path stops every rank.
      try {
        const dist::FailureGuard guard;
        KILN_FAIL(Data, "rank 1 cannot read its data (on purpose)");
      } catch (const Error& e) {
        std::fprintf(stderr, "kiln: data error: %s\n", e.what());
      }
      std::exit(2);
    }
  }
  float x = 1.0f;
  dist::allreduce(&x, 1, DType::F32, dist::Reduce::sum, "the fault test's allreduce");
  ADD_FAILURE() << "rank " << dist::rank() << " got past a collective that rank 1 never joined";
}

}  // namespace
}  // namespace kiln
