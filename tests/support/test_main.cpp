// Shared main for kiln's gtest executables: quiet logs unless KILN_LOG says otherwise.
#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  if (!std::getenv("KILN_LOG")) setenv("KILN_LOG", "warn", 0);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
