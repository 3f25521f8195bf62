// main() of the data-parallel tests. Run directly it is one process (world 1: the tests that
// need more ranks skip); under `mpirun -np 2` the launcher's variables start the process group
// before the tests, and every rank runs every test in the same order, so the collectives
// inside them meet. A failed expectation on one rank must not skip a collective on it: the
// tests use EXPECT (not ASSERT) between collectives.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "kiln/core/log.h"
#include "kiln/core/switches.h"
#include "kiln/process_group/process_group.h"

int main(int argc, char** argv) {
  kiln::Switches quiet;  // quiet logs unless KILN_LOG says otherwise
  quiet.log = "warn";
  kiln::Switches::set_base(quiet);
  const kiln::Switches switches = kiln::Switches::from_environment();
  kiln::set_log_level(switches.log_level());
  ::testing::InitGoogleTest(&argc, argv);
  // The fault case "a rank fails to start": rank 1 leaves before the process group exists.
  const char* fault = std::getenv("KILN_TEST_FAULT");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (fault && rank && std::strcmp(fault, "start") == 0 && std::strcmp(rank, "1") == 0)
    std::_Exit(6);
  kiln::dist::init(false, switches.dist_timeout);  // mpirun -x KILN_DIST_TIMEOUT=... in CMake
  const int rc = RUN_ALL_TESTS();
  kiln::dist::finalize();
  return rc;
}
