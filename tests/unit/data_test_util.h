// Helpers for the data tests: a scratch folder removed afterwards, file writes, an IDX writer
// and a check that a callable throws kiln::Error of a given kind with given text.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/data/dataset.h"

namespace kiln::data_test {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kiln_data_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// An unsigned-byte IDX file, written independently of kiln's parser.
inline std::vector<uint8_t> idx_bytes(const std::vector<uint32_t>& dims,
                                      const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(d >> s));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// Runs f, expects kiln::Error of `kind` whose message contains every string in `parts`.
inline void expect_error(const std::function<void()>& f, ErrorKind kind,
                         const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected kiln::Error(" << error_kind_name(kind) << "), nothing thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message lacks '" << p << "': " << e.what();
    }
  }
}

// Smooth enough that JPEG keeps it close, busy enough that a wrong crop shows.
inline Image smooth_pattern(int64_t h, int64_t w, int64_t c, int seed) {
  Image im;
  im.height = h, im.width = w, im.channels = c;
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t k = 0; k < c; ++k) {
        const double v =
            127 + 90 * std::sin(0.21 * x + 0.5 * k + seed) * std::cos(0.17 * y - 0.3 * seed);
        im.pixels.push_back(static_cast<uint8_t>(std::lround(v)));
      }
    }
  }
  return im;
}

}  // namespace kiln::data_test
