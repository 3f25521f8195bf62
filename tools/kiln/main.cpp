// The kiln command line: train, eval, export, plan, memory, program, bench.
#include <cstdio>
#include <exception>
#include <string>

#include "cli.h"
#include "kiln/core/error.h"

int main(int argc, char** argv) {
  try {
    return kiln::cli::run(argc, argv);
  } catch (const kiln::Error& e) {
    std::fprintf(stderr, "kiln: %s: %s\n", kiln::error_kind_name(e.kind()), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 2;
  }
}
