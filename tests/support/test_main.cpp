// Shared main for kiln's gtest executables: quiet logs unless KILN_LOG says otherwise.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (!std::getenv("KILN_LOG")) setenv("KILN_LOG", "warn", 0);
  // Tests keep autotuning's results to themselves, not in the user's ~/.cache/kiln.
  if (!std::getenv("KILN_AUTOTUNE_CACHE")) {
    const std::string dir = ::testing::TempDir() + "kiln-autotune-cache";
    setenv("KILN_AUTOTUNE_CACHE", dir.c_str(), 0);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
