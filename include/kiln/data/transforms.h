// Transforms on float HWC images (SPEC S23), each a small class composed in a Pipeline.
// Random transforms draw only from the Rng they are given; the Loader gives sample i of epoch e
// its own Rng, so augmentation does not depend on worker count or timing.
//
// Semantics follow torchvision.transforms on tensors where it matters:
//  - ToFloat is ToTensor's ÷255 (the pipeline converts bytes to floats 0..255 first);
//  - RandomResizedCrop draws the box exactly as torchvision's get_params (10 tries, then the
//    centre fallback) and resizes it with PIL's antialiased bilinear filter (sample_geometry.h),
//    as torchvision does with its default antialias=True and as PIL does: when shrinking, the
//    triangle widens to the output pixel's footprint; when enlarging it is plain bilinear with
//    half-pixel centres. Resize uses the same filter. Either may take PIL's bicubic instead
//    (torchvision's interpolation=BICUBIC); on the float path its overshoot is not clamped, as
//    torchvision's on float tensors, while the uint8 paths clamp it to bytes as PIL does. Crops,
//    resizes and flips compose into one SampleGeometry (Transform::compose), so the float, uint8
//    and GPU paths give the same pixels;
//  - RandomCrop pads with zeros on all four sides, then picks the corner uniformly;
//  - ColorJitter applies brightness, contrast, saturation and hue in a random order with
//    factors drawn as torchvision does, clamping to [0,1] after each, so it needs ToFloat
//    before it (Pipeline::add checks); saturation and hue leave 1-channel images unchanged;
//  - Resize(s) scales the shorter side to s and the longer to int(s * long / short);
//  - CenterCrop rounds the offset as Python's round() (half to even) and pads with zeros when
//    the crop is larger than the image.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kiln/core/rng.h"
#include "kiln/data/dataset.h"
#include "kiln/data/input_batch.h"
#include "kiln/data/sample_augment.h"
#include "kiln/data/sample_geometry.h"

namespace kiln {

struct FloatImage {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  std::vector<float> data;  // HWC

  FloatImage() = default;
  FloatImage(int64_t h, int64_t w, int64_t c)
      : height(h), width(w), channels(c), data(static_cast<size_t>(h * w * c), 0.0f) {}
  float& at(int64_t y, int64_t x, int64_t c) {
    return data[static_cast<size_t>((y * width + x) * channels + c)];
  }
  float at(int64_t y, int64_t x, int64_t c) const {
    return data[static_cast<size_t>((y * width + x) * channels + c)];
  }
};

// Bytes to floats with the same values (0..255).
FloatImage to_float_image(const Image& image);
// The h x w window whose top-left corner is (top, left); pixels outside the image are zero.
FloatImage crop_image(const FloatImage& image, int64_t top, int64_t left, int64_t h, int64_t w);
// Bilinear, half-pixel centres, edge pixels clamped (F.interpolate, align_corners=False,
// antialias=False): no low-pass when shrinking. The transforms use resample_float instead.
FloatImage resize_bilinear(const FloatImage& image, int64_t h, int64_t w);
// The float counterpart of resample_u8: the same taps, no rounding.
FloatImage resample_float(const FloatImage& image, const SampleGeometry& g);

class Transform {
 public:
  virtual ~Transform() = default;
  virtual void apply(FloatImage& image, Rng& rng) const = 0;
  virtual std::string describe() const = 0;
  virtual bool needs_unit_range() const { return false; }  // expects values in [0,1]
  virtual bool makes_unit_range() const { return false; }  // maps 0..255 to [0,1]
  // The uint8 and GPU input paths (sample_geometry.h): a transform that moves pixels without
  // changing their values composes into the sample's geometry, drawing from rng exactly as
  // apply() does, and returns true; one that cannot (ColorJitter, or a resize after a crop or
  // another resize: two resamplings) returns false and the pipeline stays on the float path. A
  // crop after a flip composes as the mirrored crop. ToFloat and Normalize return true and
  // leave the geometry as it is (the device applies them).
  virtual bool compose(SampleGeometry& g, Rng& rng) const {
    (void)g, (void)rng;
    return false;
  }
  // The same paths' value augmentations (sample_augment.h): a transform the backend applies to
  // the resampled sample says where (byte_ops: on its bytes before the normalisation, erase:
  // on the normalised values), and draw_augment draws its parameters for the h x w sample into
  // `a`, from rng exactly as apply() does.
  enum class ValueAugment { none, byte_ops, erase };
  virtual ValueAugment value_augment() const { return ValueAugment::none; }
  virtual void draw_augment(SampleAugment& a, int64_t h, int64_t w, Rng& rng) const {
    (void)a, (void)h, (void)w, (void)rng;
  }
};

class ToFloat : public Transform {
 public:
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override { return "ToFloat(/255)"; }
  bool makes_unit_range() const override { return true; }
  bool compose(SampleGeometry&, Rng&) const override { return true; }
};

struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

class RandomResizedCrop : public Transform {
 public:
  explicit RandomResizedCrop(int64_t size, std::array<float, 2> scale = {0.08f, 1.0f},
                             std::array<float, 2> ratio = {3.0f / 4.0f, 4.0f / 3.0f},
                             ResampleFilter filter = ResampleFilter::bilinear);
  RandomResizedCrop(int64_t height, int64_t width, std::array<float, 2> scale,
                    std::array<float, 2> ratio, ResampleFilter filter = ResampleFilter::bilinear);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry& g, Rng& rng) const override;  // false after a crop or resize
  // torchvision's RandomResizedCrop.get_params for an image of h x w.
  CropBox sample_box(int64_t h, int64_t w, Rng& rng) const;

 private:
  int64_t height_, width_;
  std::array<float, 2> scale_, ratio_;
  ResampleFilter filter_;
};

class RandomCrop : public Transform {
 public:
  explicit RandomCrop(int64_t size, int64_t padding = 0) : RandomCrop(size, size, padding) {}
  RandomCrop(int64_t height, int64_t width, int64_t padding);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry& g, Rng& rng) const override;

 private:
  int64_t height_, width_, padding_;
};

class RandomHorizontalFlip : public Transform {
 public:
  explicit RandomHorizontalFlip(float p = 0.5f);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry& g, Rng& rng) const override;

 private:
  float p_;
};

class ColorJitter : public Transform {
 public:
  // Each factor f > 0 draws from [max(0, 1-f), 1+f]; hue h in [0, 0.5] draws a shift from [-h, h].
  ColorJitter(float brightness, float contrast, float saturation, float hue = 0.0f);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool needs_unit_range() const override { return true; }

 private:
  float brightness_, contrast_, saturation_, hue_;
};

class Normalize : public Transform {
 public:
  Normalize(std::vector<float> mean, std::vector<float> std);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry&, Rng&) const override { return true; }
  const std::vector<float>& mean() const { return mean_; }
  const std::vector<float>& std() const { return std_; }

 private:
  std::vector<float> mean_, std_, inv_std_;
};

// torchvision's RandomErasing on the normalised image: with probability p, a box of
// scale x area pixels and aspect (h / w) drawn log-uniformly from ratio is set to value in every
// channel; 10 tries, then nothing is erased. The uint8 and GPU paths erase where the batch lands
// (after Normalize, so it must come last there).
class RandomErasing : public Transform {
 public:
  explicit RandomErasing(float p, std::array<float, 2> scale = {0.02f, 0.33f},
                         std::array<float, 2> ratio = {0.3f, 3.3f}, float value = 0.0f);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  // The p draw and get_params for an h x w image: the box, or height 0 when nothing is erased.
  CropBox sample_box(int64_t h, int64_t w, Rng& rng) const;
  ValueAugment value_augment() const override { return ValueAugment::erase; }
  void draw_augment(SampleAugment& a, int64_t h, int64_t w, Rng& rng) const override;

 private:
  float p_;
  std::array<float, 2> scale_, ratio_;
  float value_;
};

class Resize : public Transform {
 public:
  explicit Resize(int64_t shorter_side, ResampleFilter filter = ResampleFilter::bilinear);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry& g, Rng& rng) const override;  // false after a crop or resize

 private:
  int64_t shorter_;
  ResampleFilter filter_;
};

class CenterCrop : public Transform {
 public:
  explicit CenterCrop(int64_t size) : CenterCrop(size, size) {}
  CenterCrop(int64_t height, int64_t width);
  void apply(FloatImage& image, Rng& rng) const override;
  std::string describe() const override;
  bool compose(SampleGeometry& g, Rng& rng) const override;

 private:
  int64_t height_, width_;
};

// An ordered list of transforms, shared read-only by the Loader's workers.
class Pipeline {
 public:
  Pipeline() = default;
  Pipeline& add(std::shared_ptr<const Transform> transform);
  template <typename T, typename... Args>
  Pipeline& add(Args&&... args) {
    return add(std::make_shared<const T>(std::forward<Args>(args)...));
  }

  // Bytes to floats (0..255), then every transform in order.
  FloatImage operator()(const Image& image, Rng& rng) const;
  void apply(FloatImage& image, Rng& rng) const;
  std::string describe() const;  // "ToFloat(/255) -> RandomCrop(32, pad 4) -> ..."
  size_t size() const { return transforms_.size(); }

  // Whether the uint8 / GPU path can run this pipeline: ToFloat, the geometric transforms,
  // then at most one Normalize, last (the reason when not).
  bool geometric(std::string* why_not = nullptr) const;
  // The same, with value augmentations the backend applies (sample_augment.h): AutoAugment
  // after the geometric transforms and before Normalize, at most one RandomErasing, last.
  bool geometric_with_augments(std::string* why_not = nullptr) const;
  bool has_augments() const;  // an AutoAugment or RandomErasing
  // The sample's geometry for a source of h x w, drawing from rng as operator() would, so both
  // paths crop the same boxes. Needs geometric().
  SampleGeometry geometry(int64_t h, int64_t w, Rng& rng) const;
  // The same and, in `augment`, the value augmentations drawn after it (in the order and from
  // the rng state of the float path's draws). Needs geometric_with_augments().
  SampleGeometry geometry(int64_t h, int64_t w, Rng& rng, SampleAugment& augment) const;
  // The final Normalize's statistics on [0,1] pixels (mean 0, std 1 per channel when none),
  // such that (p / 255 - mean) / std is what the float path gives: without a ToFloat before
  // it, the float path's values are 0..255, so mean and std come out divided by 255.
  InputNormalization normalization(int64_t channels) const;

 private:
  bool check_geometric(std::string* why_not, bool augments) const;

  std::vector<std::shared_ptr<const Transform>> transforms_;
  bool unit_range_ = false;  // a ToFloat has been added
};

}  // namespace kiln
