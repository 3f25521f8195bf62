// Shared main for kiln's gtest executables: quiet logs unless KILN_LOG says otherwise, and
// autotuning's results kept to the tests, not in the user's ~/.cache/kiln (both as the base
// the process's switches start from; a KILN_* variable still wins).
#include <gtest/gtest.h>

#include <string>

#include "kiln/core/log.h"
#include "kiln/core/switches.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kiln::Switches base;
  base.log = "warn";
  base.autotune_cache = ::testing::TempDir() + "kiln-autotune-cache";
  kiln::Switches::set_base(base);
  kiln::set_log_level(kiln::Switches::from_environment().log_level());
  return RUN_ALL_TESTS();
}
