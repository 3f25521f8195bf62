// Running the kiln command line from tests as a user would, and the small files those tests
// write (IDX splits): one copy for every CLI test file.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kiln::test {

struct CliResult {
  int code = -1;    // the exit status; -1 when the process did not exit normally
  std::string out;  // stdout and stderr together
};

// A shell command line, its stdout and stderr captured together. The kiln it starts logs at
// warn, as the tests do (test_main.cpp), unless KILN_LOG says otherwise.
inline CliResult run_shell(const std::string& cmd) {
  CliResult r;
  FILE* p = popen(("export KILN_LOG=\"${KILN_LOG:-warn}\"; " + cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The built kiln binary with these arguments.
inline CliResult run_kiln(const std::string& args) {
  return run_shell(std::string(KILN_CLI_PATH) + " " + args);
}

inline void write_bytes(const std::filesystem::path& path, const std::vector<uint8_t>& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// An IDX file (ubyte data) of the given dimensions.
inline std::vector<uint8_t> idx_file(const std::vector<uint32_t>& dims,
                                     const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(d >> s));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

}  // namespace kiln::test
