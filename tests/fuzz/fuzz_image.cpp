// libFuzzer target for the JPEG and PNG decoders (image folders read files nobody checked:
// ImageNet has CMYK, greyscale and truncated JPEGs). Properties: decode_image never aborts the
// process and throws only Error(Data) (libjpeg's and libpng's fatal errors are longjmp'd out
// of; ASan and UBSan watch the buffers); a decoded image has the requested channels and
// height x width x channels bytes; 1 and 3 channels agree on the size. read_image_info and the
// cropped / DCT-scaled decode_resampled (with a RandomResizedCrop + flip geometry drawn from a
// seed taken from the input) obey the same rules, and the header agrees with the decode.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/transforms.h"

namespace {

// Far below the library's limit: a 4 KB input claiming 16k x 16k pixels would otherwise spend
// the fuzzer's memory budget, which says nothing about the decoder's correctness.
constexpr int64_t kFuzzMaxPixels = int64_t{1} << 20;

bool decode(const uint8_t* data, size_t size, int64_t channels, kiln::Image& out) {
  try {
    out = kiln::decode_image(data, size, channels, "fuzz-input", kFuzzMaxPixels);
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Data) std::abort();
    return false;
  }
  if (out.channels != channels || out.height <= 0 || out.width <= 0) std::abort();
  if (out.height * out.width > kFuzzMaxPixels) std::abort();
  if (out.pixels.size() != static_cast<size_t>(out.height * out.width * channels)) std::abort();
  return true;
}

template <typename F>
bool only_data_errors(F&& f) {
  try {
    f();
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Data) std::abort();
    return false;
  }
  return true;
}

// The header, then decode_resampled with every combination of DCT scaling and cropping.
void decode_windows(const uint8_t* data, size_t size, const kiln::Image* decoded) {
  kiln::ImageInfo info;
  if (!only_data_errors([&] { info = kiln::read_image_info(data, size, "fuzz-input"); })) {
    if (decoded) std::abort();  // a decodable file has a readable header
    return;
  }
  if (info.height <= 0 || info.width <= 0) std::abort();
  if (decoded && (info.height != decoded->height || info.width != decoded->width)) std::abort();
  if (info.height * info.width > kFuzzMaxPixels) return;
  uint64_t seed = size;
  for (size_t i = size > 8 ? size - 8 : 0; i < size; ++i) seed = seed * 131 + data[i];
  kiln::Pipeline p;
  p.add<kiln::RandomResizedCrop>(1 + static_cast<int64_t>(seed % 48))
      .add<kiln::RandomHorizontalFlip>();
  kiln::Rng rng(seed);
  const kiln::SampleGeometry g = p.geometry(info.height, info.width, rng);
  std::vector<uint8_t> out(static_cast<size_t>(g.out_h() * g.out_w() * 3));
  for (int mode = 0; mode < 5; ++mode) {
    kiln::ResampledDecodeOptions o;
    o.dct_scaling = mode & 1;
    o.crop = mode & 2;
    // Mode 4: crop with the progressive early stop off and the float resample; the others
    // have both on (the defaults).
    o.crop = o.crop || mode == 4;
    o.progressive_stop = mode != 4;
    o.math = mode == 4 ? kiln::ResampleMath::float32 : kiln::ResampleMath::fixed16;
    o.max_pixels = kFuzzMaxPixels;
    only_data_errors([&] {
      kiln::decode_resampled(data, size, 3 - 2 * (mode == 3), g, out.data(), "fuzz-input", o);
    });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::Image rgb, grey;
  const bool a = decode(data, size, 3, rgb);
  const bool b = decode(data, size, 1, grey);
  if (a != b) std::abort();
  if (a && (rgb.height != grey.height || rgb.width != grey.width)) std::abort();
  decode_windows(data, size, a ? &rgb : nullptr);
  return 0;
}
