// libFuzzer target for the JPEG and PNG decoders (image folders read files nobody checked:
// ImageNet has CMYK, greyscale and truncated JPEGs). Properties: decode_image never aborts the
// process and throws only Error(Data) (libjpeg's and libpng's fatal errors are longjmp'd out
// of; ASan and UBSan watch the buffers); a decoded image has the requested channels and
// height x width x channels bytes; 1 and 3 channels agree on the size.
#include <cstdint>
#include <cstdlib>

#include "kiln/core/error.h"
#include "kiln/data/image_codec.h"

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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::Image rgb, grey;
  const bool a = decode(data, size, 3, rgb);
  const bool b = decode(data, size, 1, grey);
  if (a != b) std::abort();
  if (a && (rgb.height != grey.height || rgb.width != grey.width)) std::abort();
  return 0;
}
