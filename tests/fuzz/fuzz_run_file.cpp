// libFuzzer target for run-file parsing (kiln's code around yaml-cpp). Properties: the only
// exception that may leave parse_run_file is Error(Config), whatever yaml-cpp throws inside;
// every option it returns has a non-empty name without underscores, and names are unique.
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

#include "kiln/core/error.h"
#include "kiln/io/run_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Run files are a few hundred bytes; larger inputs only slow the search down.
  if (size > 4096) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  kiln::RunOptions options;
  try {
    options = kiln::parse_run_file(text, "fuzz-input");
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Config) std::abort();
    return 0;
  }
  std::set<std::string> names;
  for (const auto& [key, value] : options) {
    if (key.empty() || key.find('_') != std::string::npos) std::abort();
    if (!names.insert(key).second) std::abort();
  }
  return 0;
}
