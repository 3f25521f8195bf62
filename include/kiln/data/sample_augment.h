// A sample's value augmentations on the uint8 and GPU input paths: the ops RandAugment /
// TrivialAugmentWide drew for it (applied to its resampled bytes, in order) and the box
// RandomErasing drew (set to its value after the normalisation). The loader draws them with the
// sample's geometry, from the same Rng and in the same order as the float transforms do, so a
// sample is augmented alike whichever path makes it; the backend applies them where the batch
// lands (the CPU backend's staging pass, or the CUDA input kernels).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace kiln {

// In torchvision's order of _augmentation_space: an op index drawn from [0, 14) means the same
// op as there.
enum class AugmentOp : int32_t {
  identity,
  shear_x,
  shear_y,
  translate_x,
  translate_y,
  rotate,
  brightness,
  color,
  contrast,
  sharpness,
  posterize,
  solarize,
  autocontrast,
  equalize,
};
inline constexpr int kAugmentOps = 14;
const char* augment_op_name(AugmentOp op);

// Output pixels [top, top + height) x [left, left + width) of the normalised sample are set to
// `value` in every channel; height 0 (or width 0): nothing is erased.
struct EraseBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
  float value = 0;
  bool operator==(const EraseBox&) const = default;
};

struct SampleAugment {
  std::vector<std::pair<AugmentOp, double>> ops;  // op and signed magnitude, in order
  EraseBox erase;
  bool empty() const { return ops.empty() && erase.height == 0; }
  bool operator==(const SampleAugment&) const = default;
};

// One op with its magnitude resolved, for an image of h x w, into the constants its arithmetic
// reads: the host's apply_augment_op and the CUDA kernel both compute from these same floats,
// so they agree to the byte.
struct AugmentOpParams {
  int32_t op = 0;    // AugmentOp
  int32_t bits = 0;  // posterize: the bits kept; solarize: the threshold, ceil(magnitude)
  float ratio = 1;   // brightness, color, contrast, sharpness: _blend's ratio and 1 - ratio
  float rest = 0;
  // Shears, translations, rotate: the affine grid's float coefficients, (x, y, 1) of a pixel
  // centre relative to the image centre -> grid_sample's normalised (gx, gy):
  // gx = (x * grid[0] + y * grid[1]) + grid[2], gy = (x * grid[3] + y * grid[4]) + grid[5].
  float grid[6] = {};
};
AugmentOpParams augment_op_params(AugmentOp op, double magnitude, int64_t h, int64_t w);
bool augment_op_is_geometric(AugmentOp op);

}  // namespace kiln
