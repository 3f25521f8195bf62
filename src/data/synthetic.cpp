#include "kiln/data/synthetic.h"

#include <cstring>

#include "kiln/core/error.h"
#include "kiln/core/rng.h"

namespace kiln {

SyntheticDataset::SyntheticDataset(int64_t samples, int64_t height, int64_t width, int64_t channels,
                                   int64_t classes, uint64_t seed)
    : samples_(samples),
      height_(height),
      width_(width),
      channels_(channels),
      classes_(classes),
      seed_(seed) {
  KILN_CHECK(samples > 0 && height > 0 && width > 0 && channels > 0 && classes > 0, InvalidArgument,
             "synthetic data needs positive samples, height, width, channels "
             "and classes; got ",
             samples, ", ", height, "x", width, "x", channels, ", ", classes);
  KILN_CHECK(height * width * channels <= (int64_t{1} << 28), InvalidArgument,
             "synthetic images of ", height, "x", width, "x", channels, " are too large");
}

Sample SyntheticDataset::sample(int64_t index) const {
  KILN_CHECK(index >= 0 && index < samples_, InvalidArgument, "sample index ", index,
             " is outside [0, ", samples_, ") of ", describe());
  // Stream (seed, index, 1) for the pixels; the label takes the first draw.
  Rng rng = Rng::derive(seed_, static_cast<uint64_t>(index), 1);
  Sample s;
  s.label = static_cast<int32_t>(rng.below(static_cast<uint64_t>(classes_)));
  s.image.height = height_;
  s.image.width = width_;
  s.image.channels = channels_;
  s.image.pixels.resize(static_cast<size_t>(height_ * width_ * channels_));
  uint8_t* p = s.image.pixels.data();
  size_t left = s.image.pixels.size();
  while (left > 0) {  // 8 bytes per draw
    const uint64_t v = rng.next_u64();
    const size_t n = left < 8 ? left : 8;
    std::memcpy(p, &v, n);
    p += n;
    left -= n;
  }
  return s;
}

std::string SyntheticDataset::describe() const {
  return "synthetic: " + std::to_string(samples_) + " images of " + std::to_string(height_) + "x" +
         std::to_string(width_) + "x" + std::to_string(channels_) + ", " +
         std::to_string(classes_) + " classes, seed " + std::to_string(seed_);
}

}  // namespace kiln
