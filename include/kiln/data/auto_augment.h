// RandAugment and TrivialAugmentWide (--auto-augment ra|ta_wide): torchvision's policies and its
// ops on uint8 tensors (transforms.functional on tensors), HWC here. The arithmetic follows
// torchvision's float32 steps and truncations (a blend's .to(uint8) truncates; the sharpness
// blur rounds), the geometric ops sample the nearest source pixel through torchvision's
// inverse affine matrix and affine grid, and pixels from outside the image are 0.
//
// On the float pipeline the transform rounds its [0, 1] input to bytes (what a uint8 image
// would hold), runs the ops and divides by 255 again, so it needs ToFloat before it. The op
// and magnitude choices draw from the sample's Rng, like every random transform. On the uint8
// and GPU paths the loader draws them (draw_augment) and the backend applies them to the
// resampled bytes (sample_augment.h).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kiln/data/dataset.h"
#include "kiln/data/sample_augment.h"
#include "kiln/data/transforms.h"

namespace kiln {

// torchvision's _apply_op(img, op, magnitude) with nearest sampling and fill 0: shears take the
// magnitude as the shear factor (tan of the angle), translations whole pixels (truncated),
// rotate degrees counter-clockwise, the colour ops the factor 1 + magnitude, posterize the bits
// kept, solarize the threshold.
void apply_augment_op(Image& image, AugmentOp op, double magnitude);
// The same from the op's resolved constants (augment_op_params for this image's size): the
// reference the CUDA kernel's arithmetic follows step by step.
void apply_augment_params(Image& image, const AugmentOpParams& params);

// torch.linspace(start, end, steps)[i] in float32, as its CPU kernel computes it (the two halves
// from either end), which is where torchvision's magnitudes come from.
float linspace_f32(double start, double end, int64_t steps, int64_t i);

enum class AutoAugmentPolicy { rand_augment, trivial_augment_wide };
// "ra" or "ta_wide" (torchvision's reference --auto-augment names); anything else is refused.
AutoAugmentPolicy parse_auto_augment(const std::string& name);

class AutoAugment : public Transform {
 public:
  // RandAugment(num_ops, magnitude, num_magnitude_bins) or TrivialAugmentWide(bins), whose
  // num_ops and magnitude are unused (it draws one op and its magnitude bin per image).
  AutoAugment(AutoAugmentPolicy policy, int num_ops = 2, int magnitude = 9, int bins = 31);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool needs_unit_range() const override { return true; }
  ValueAugment value_augment() const override { return ValueAugment::byte_ops; }
  void draw_augment(SampleAugment& a, int64_t h, int64_t w, Rng& rng) const override;

  // The ops and signed magnitudes one image of h x w draws, in the order applied.
  std::vector<std::pair<AugmentOp, double>> draw(int64_t h, int64_t w, Rng& rng) const;
  // The magnitude of `op` at bin `bin` for an h x w image (0 for the ops without one), before
  // the sign draw; whether the op draws a sign.
  double magnitude(AugmentOp op, int bin, int64_t h, int64_t w) const;
  static bool signed_op(AugmentOp op);

 private:
  AutoAugmentPolicy policy_;
  int num_ops_, magnitude_, bins_;
};

}  // namespace kiln
