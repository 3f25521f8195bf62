// Writes the JPEG seeds of tests/fuzz/corpus/image with kiln's own encoder (the PNG seeds are
// copies of tests/data/png, made by Python). Build and run from the repository root:
//   g++ -std=c++20 -Iinclude -Isrc tests/fuzz/make_image_corpus.cpp src/data/image_codec.cpp \
//       src/core/error.cpp -ljpeg -lpng -o /tmp/make_image_corpus && /tmp/make_image_corpus
//   cp tests/data/png/*.png tests/fuzz/corpus/image/
#include <cstdio>
#include <string>
#include <vector>

#include "kiln/data/image_codec.h"

namespace {

kiln::Image pattern(int64_t h, int64_t w, int64_t c) {
  kiln::Image img;
  img.height = h;
  img.width = w;
  img.channels = c;
  for (int64_t i = 0; i < h * w * c; ++i) img.pixels.push_back(static_cast<uint8_t>(i * 29 % 251));
  return img;
}

void write(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = "tests/fuzz/corpus/image/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) {
    std::perror(path.c_str());
    return;
  }
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

}  // namespace

int main() {
  write("rgb_8x8.jpg", kiln::encode_jpeg(pattern(8, 8, 3), 90));
  write("grey_9x7.jpg", kiln::encode_jpeg(pattern(9, 7, 1), 75));
  write("cmyk_8x8.jpg", kiln::encode_jpeg(pattern(8, 8, 4), 80));
  std::vector<uint8_t> cut = kiln::encode_jpeg(pattern(16, 16, 3), 95);
  cut.resize(cut.size() * 2 / 3);
  write("truncated_16x16.jpg", cut);
  write("rgba_3x2.png", kiln::encode_png(pattern(2, 3, 4)));
  return 0;
}
