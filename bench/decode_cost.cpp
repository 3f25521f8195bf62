// One loader worker's work per image, without the loader, the engine or threads, so that
// `valgrind --tool=callgrind --toggle-collect='*decode_cost_one*'` counts the instructions of
// exactly that (issue 16): the uint8 path (read_image_info, the sample's geometry,
// decode_resampled) or the float path (decode_image, then the float transforms), on every
// k-th file of an image folder's train split, with `kiln bench`'s transforms and its
// (seed, epoch, index) draws. Bytes are read before timing. Prints an FNV-1a checksum of the
// outputs (equal across runs whose switches keep the pixels) and the thread CPU time.
//
//   g++ -O2 -std=c++20 -Iinclude bench/decode_cost.cpp -Lbuild -lkiln -Wl,-rpath,$PWD/build \
//       -o build/decode_cost
//   build/decode_cost DIR N u8|float [fixed=0|1] [stop=0|1] [repeat=R]
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/transforms.h"

namespace {

uint64_t fnv(uint64_t h, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Job {
  const kiln::Pipeline* pipeline;
  kiln::ResampledDecodeOptions options;
  bool u8;
  std::vector<uint8_t> out;
  std::vector<float> fout;
};

__attribute__((noinline)) void decode_cost_one(Job& job, const std::vector<uint8_t>& bytes,
                                               const std::string& name, uint64_t index) {
  kiln::Rng rng = kiln::Rng::derive(0, 0, index + 1);
  if (job.u8) {
    const kiln::ImageInfo info = kiln::read_image_info(bytes.data(), bytes.size(), name);
    const kiln::SampleGeometry g = job.pipeline->geometry(info.height, info.width, rng);
    job.out.resize(static_cast<size_t>(g.out_h() * g.out_w() * 3));
    kiln::decode_resampled(bytes.data(), bytes.size(), 3, g, job.out.data(), name, job.options);
    return;
  }
  const kiln::Image img = kiln::decode_image(bytes.data(), bytes.size(), 3, name);
  job.fout = (*job.pipeline)(img, rng).data;
}

// Outside the counted function.
uint64_t output_checksum(const Job& job, uint64_t h) {
  if (job.u8) return fnv(h, job.out.data(), job.out.size());
  return fnv(h, reinterpret_cast<const uint8_t*>(job.fout.data()), job.fout.size() * sizeof(float));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s DIR N u8|float [fixed=0|1] [stop=0|1] [repeat=R]\n", argv[0]);
    return 2;
  }
  std::vector<std::string> files;
  for (const auto& e :
       std::filesystem::recursive_directory_iterator(std::filesystem::path(argv[1]) / "train")) {
    if (e.is_regular_file()) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  const size_t n = std::min(files.size(), static_cast<size_t>(std::atol(argv[2])));
  const size_t step = files.size() / std::max<size_t>(n, 1);
  Job job;
  job.u8 = std::strcmp(argv[3], "u8") == 0;
  int repeat = 1;
  for (int i = 4; i < argc; ++i) {
    if (std::strncmp(argv[i], "fixed=", 6) == 0) {
      job.options.math =
          argv[i][6] == '1' ? kiln::ResampleMath::fixed16 : kiln::ResampleMath::float32;
    } else if (std::strncmp(argv[i], "stop=", 5) == 0) {
      job.options.progressive_stop = argv[i][5] == '1';
    } else if (std::strncmp(argv[i], "repeat=", 7) == 0) {
      repeat = std::atoi(argv[i] + 7);
    }
  }
  kiln::Pipeline p;
  p.add<kiln::ToFloat>()
      .add<kiln::RandomResizedCrop>(224)
      .add<kiln::RandomHorizontalFlip>(0.5f)
      .add<kiln::Normalize>(std::vector<float>{0.485f, 0.456f, 0.406f},
                            std::vector<float>{0.229f, 0.224f, 0.225f});
  job.pipeline = &p;
  std::vector<std::vector<uint8_t>> bytes(n);
  for (size_t i = 0; i < n; ++i) {
    std::ifstream in(files[i * step], std::ios::binary);
    bytes[i].assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t h = 1469598103934665603ull;
  const double t0 = thread_seconds();
  for (int r = 0; r < repeat; ++r) {
    for (size_t i = 0; i < n; ++i) {
      decode_cost_one(job, bytes[i], files[i * step], i * step);
      h = output_checksum(job, h);
    }
  }
  const double t = thread_seconds() - t0;
  std::printf("%s: %zu files x %d, %.1f us an image (thread CPU), checksum %016llx\n", argv[3], n,
              repeat, 1e6 * t / static_cast<double>(n * static_cast<size_t>(repeat)),
              static_cast<unsigned long long>(h));
  return 0;
}
