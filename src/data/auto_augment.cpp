// torchvision's RandAugment / TrivialAugmentWide and the uint8 tensor ops they apply
// (_functional_tensor.py), on HWC bytes. Built with -ffp-contract=off (CMakeLists.txt): the
// float32 steps must round one at a time, as PyTorch's kernels do, for the truncations to agree.
#include "kiln/data/auto_augment.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln {
namespace {

constexpr double kPi = 3.14159265358979323846;

uint8_t to_u8(float v) {  // clamp(0, 255).to(uint8): truncation toward zero
  v = std::min(255.0f, std::max(0.0f, v));
  return static_cast<uint8_t>(v);
}

// _blend(img1, img2, ratio) for one value: ratio and 1 - ratio are float32 scalars (r, q).
uint8_t blend(uint8_t a, float b, float r, float q) {
  const float x = r * static_cast<float>(a);
  const float y = q * b;
  return to_u8(x + y);
}

// rgb_to_grayscale: 0.2989 r + 0.587 g + 0.114 b in float32, truncated to uint8.
uint8_t grey(const uint8_t* p) {
  const float r = 0.2989f * static_cast<float>(p[0]);
  const float g = 0.587f * static_cast<float>(p[1]);
  const float b = 0.114f * static_cast<float>(p[2]);
  return to_u8((r + g) + b);
}

void adjust_brightness(Image& im, float r, float q) {
  for (uint8_t& v : im.pixels) v = blend(v, 0.0f, r, q);
}

void adjust_saturation(Image& im, float r, float q) {
  if (im.channels != 3) return;  // torchvision returns 1-channel images as they are
  for (int64_t p = 0; p < im.height * im.width; ++p) {
    uint8_t* px = &im.pixels[static_cast<size_t>(p * 3)];
    const float g = grey(px);
    for (int k = 0; k < 3; ++k) px[k] = blend(px[k], g, r, q);
  }
}

void adjust_contrast(Image& im, float r, float q) {
  // The mean of the (truncated) grey image in float32: torch sums (exactly, integers below
  // 2^24 here) and divides by the count.
  const int64_t n = im.height * im.width;
  int64_t sum = 0;
  for (int64_t p = 0; p < n; ++p) {
    const uint8_t* px = &im.pixels[static_cast<size_t>(p * im.channels)];
    sum += im.channels == 3 ? grey(px) : px[0];
  }
  const float mean = static_cast<float>(sum) / static_cast<float>(n);
  for (uint8_t& v : im.pixels) v = blend(v, mean, r, q);
}

void adjust_sharpness(Image& im, float r, float q) {
  if (im.width <= 2 || im.height <= 2) return;
  // The blur [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded to bytes, on the interior; the border keeps
  // its pixels. round(S / 13) of an integer S is never a tie, so integer arithmetic gives it.
  const int64_t c = im.channels, w = im.width;
  std::vector<float> blurred(im.pixels.begin(), im.pixels.end());
  for (int64_t y = 1; y + 1 < im.height; ++y) {
    for (int64_t x = 1; x + 1 < w; ++x) {
      for (int64_t k = 0; k < c; ++k) {
        int64_t s = 0;
        for (int64_t dy = -1; dy <= 1; ++dy) {
          for (int64_t dx = -1; dx <= 1; ++dx) {
            s += im.pixels[static_cast<size_t>(((y + dy) * w + x + dx) * c + k)];
          }
        }
        s += 4 * im.pixels[static_cast<size_t>((y * w + x) * c + k)];
        blurred[static_cast<size_t>((y * w + x) * c + k)] = static_cast<float>((2 * s + 13) / 26);
      }
    }
  }
  for (size_t i = 0; i < im.pixels.size(); ++i) {
    im.pixels[i] = blend(im.pixels[i], blurred[i], r, q);
  }
}

void posterize(Image& im, int bits) {
  const int mask = -(1 << (8 - bits));
  for (uint8_t& v : im.pixels) v = static_cast<uint8_t>(v & mask);
}

// threshold: the least byte inverted, ceil of torchvision's (a byte v >= t iff v >= ceil(t)).
void solarize(Image& im, int threshold) {
  for (uint8_t& v : im.pixels) v = v >= threshold ? static_cast<uint8_t>(255 - v) : v;
}

void autocontrast(Image& im) {
  const int64_t c = im.channels, n = im.height * im.width;
  for (int64_t k = 0; k < c; ++k) {
    uint8_t lo = 255, hi = 0;
    for (int64_t p = 0; p < n; ++p) {
      lo = std::min(lo, im.pixels[static_cast<size_t>(p * c + k)]);
      hi = std::max(hi, im.pixels[static_cast<size_t>(p * c + k)]);
    }
    float minimum = lo, scale = 255.0f / (static_cast<float>(hi) - static_cast<float>(lo));
    if (!std::isfinite(scale)) minimum = 0, scale = 1;
    for (int64_t p = 0; p < n; ++p) {
      uint8_t& v = im.pixels[static_cast<size_t>(p * c + k)];
      v = to_u8((static_cast<float>(v) - minimum) * scale);
    }
  }
}

void equalize(Image& im) {
  const int64_t c = im.channels, n = im.height * im.width;
  for (int64_t k = 0; k < c; ++k) {
    std::array<int64_t, 256> hist{};
    for (int64_t p = 0; p < n; ++p) ++hist[im.pixels[static_cast<size_t>(p * c + k)]];
    // step: the non-zero bins but the last, summed, floor-divided by 255.
    int64_t last = 255;
    while (last > 0 && hist[static_cast<size_t>(last)] == 0) --last;
    int64_t rest = 0;
    for (int64_t v = 0; v < last; ++v) rest += hist[static_cast<size_t>(v)];
    const int64_t step = rest / 255;
    if (step == 0) continue;
    std::array<uint8_t, 256> lut{};
    int64_t cum = 0;
    for (int64_t v = 0; v < 256; ++v) {
      // lut shifted right by one bin: value v maps from the counts below it.
      lut[static_cast<size_t>(v)] =
          static_cast<uint8_t>(std::min<int64_t>(255, (cum + step / 2) / step));
      cum += hist[static_cast<size_t>(v)];
    }
    for (int64_t p = 0; p < n; ++p) {
      uint8_t& v = im.pixels[static_cast<size_t>(p * c + k)];
      v = lut[v];
    }
  }
}

// _get_inverse_affine_matrix(center, angle, translate, scale 1, shear), in double as Python.
std::array<double, 6> inverse_affine(double cx, double cy, double angle, double tx, double ty,
                                     double shear_x, double shear_y) {
  const double rot = angle * kPi / 180.0, sx = shear_x * kPi / 180.0, sy = shear_y * kPi / 180.0;
  const double a = std::cos(rot - sy) / std::cos(sy);
  const double b = -std::cos(rot - sy) * std::tan(sx) / std::cos(sy) - std::sin(rot);
  const double c = std::sin(rot - sy) / std::cos(sy);
  const double d = -std::sin(rot - sy) * std::tan(sx) / std::cos(sy) + std::cos(rot);
  std::array<double, 6> m = {d, -b, 0.0, -c, a, 0.0};
  m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
  m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
  m[2] += cx;
  m[5] += cy;
  return m;
}

// F_t.affine with nearest sampling and zero fill: _gen_affine_grid's float32 grid over pixel
// centres relative to the image centre (coefficients from affine_grid below), then
// grid_sample's unnormalisation (align_corners False) and round half to even.
void affine_nearest(Image& im, const float* r) {
  const int64_t h = im.height, w = im.width, c = im.channels;
  const float hw = 0.5f * static_cast<float>(w), hh = 0.5f * static_cast<float>(h);
  const float fw = static_cast<float>(w), fh = static_cast<float>(h);
  std::vector<uint8_t> out(im.pixels.size(), 0);
  for (int64_t y = 0; y < h; ++y) {
    const float yc = -hh + 0.5f + static_cast<float>(y);
    for (int64_t x = 0; x < w; ++x) {
      const float xc = -hw + 0.5f + static_cast<float>(x);
      const float gx = (xc * r[0] + yc * r[1]) + r[2];
      const float gy = (xc * r[3] + yc * r[4]) + r[5];
      const float ix = std::nearbyint(((gx + 1.0f) * fw - 1.0f) / 2.0f);
      const float iy = std::nearbyint(((gy + 1.0f) * fh - 1.0f) / 2.0f);
      if (!(ix >= 0 && ix < fw && iy >= 0 && iy < fh)) continue;
      const uint8_t* s = &im.pixels[static_cast<size_t>(
          (static_cast<int64_t>(iy) * w + static_cast<int64_t>(ix)) * c)];
      std::copy(s, s + c, &out[static_cast<size_t>((y * w + x) * c)]);
    }
  }
  im.pixels = std::move(out);
}

// The matrix in float32 divided by the half sizes: _gen_affine_grid's base grid times theta.
void affine_grid(const std::array<double, 6>& m, int64_t h, int64_t w, float* r) {
  const float hw = 0.5f * static_cast<float>(w), hh = 0.5f * static_cast<float>(h);
  float t[6];
  for (int i = 0; i < 6; ++i) t[i] = static_cast<float>(m[static_cast<size_t>(i)]);
  r[0] = t[0] / hw, r[1] = t[1] / hw, r[2] = t[2] / hw;
  r[3] = t[3] / hh, r[4] = t[4] / hh, r[5] = t[5] / hh;
}

double degrees_of_atan(double m) {
  return std::atan(m) * 180.0 / kPi;
}

}  // namespace

const char* augment_op_name(AugmentOp op) {
  static const char* const kNames[kAugmentOps] = {
      "Identity", "ShearX",   "ShearY",    "TranslateX", "TranslateY", "Rotate",       "Brightness",
      "Color",    "Contrast", "Sharpness", "Posterize",  "Solarize",   "AutoContrast", "Equalize"};
  return kNames[static_cast<int>(op)];
}

bool augment_op_is_geometric(AugmentOp op) {
  return op >= AugmentOp::shear_x && op <= AugmentOp::rotate;
}

AugmentOpParams augment_op_params(AugmentOp op, double mag, int64_t h, int64_t w) {
  KILN_CHECK(static_cast<int>(op) >= 0 && static_cast<int>(op) < kAugmentOps, InvalidArgument,
             "augment op ", static_cast<int>(op), " is not one of the ", kAugmentOps, " ops");
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, augment_op_name(op), " on an empty image (", h, "x",
             w, ")");
  AugmentOpParams p;
  p.op = static_cast<int32_t>(op);
  const double fw = static_cast<double>(w), fh = static_cast<double>(h);
  auto factor = [&](double f) {  // _blend's float32 ratio and 1 - ratio
    p.ratio = static_cast<float>(f);
    p.rest = static_cast<float>(1.0 - f);
  };
  switch (op) {
    case AugmentOp::shear_x:  // about the top-left corner: center [0, 0]
      affine_grid(inverse_affine(-0.5 * fw, -0.5 * fh, 0, 0, 0, degrees_of_atan(mag), 0), h, w,
                  p.grid);
      break;
    case AugmentOp::shear_y:
      affine_grid(inverse_affine(-0.5 * fw, -0.5 * fh, 0, 0, 0, 0, degrees_of_atan(mag)), h, w,
                  p.grid);
      break;
    case AugmentOp::translate_x:
      affine_grid(inverse_affine(0, 0, 0, std::trunc(mag), 0, 0, 0), h, w, p.grid);
      break;
    case AugmentOp::translate_y:
      affine_grid(inverse_affine(0, 0, 0, 0, std::trunc(mag), 0, 0), h, w, p.grid);
      break;
    case AugmentOp::rotate:  // F.rotate passes -angle to the matrix
      affine_grid(inverse_affine(0, 0, -mag, 0, 0, 0, 0), h, w, p.grid);
      break;
    case AugmentOp::brightness:
    case AugmentOp::color:
    case AugmentOp::contrast:
    case AugmentOp::sharpness:
      factor(1.0 + mag);
      break;
    case AugmentOp::posterize:
      p.bits = static_cast<int32_t>(mag);
      KILN_CHECK(p.bits >= 0 && p.bits <= 8, InvalidArgument, "Posterize keeps 0 to 8 bits, not ",
                 mag);
      break;
    case AugmentOp::solarize:
      KILN_CHECK(std::isfinite(mag), InvalidArgument, "Solarize's threshold must be finite, got ",
                 mag);
      p.bits = static_cast<int32_t>(std::clamp(std::ceil(mag), 0.0, 256.0));
      break;
    default:
      break;
  }
  return p;
}

void apply_augment_params(Image& im, const AugmentOpParams& p) {
  const auto op = static_cast<AugmentOp>(p.op);
  KILN_CHECK(p.op >= 0 && p.op < kAugmentOps, InvalidArgument, "augment op ", p.op,
             " is not one of the ", kAugmentOps, " ops");
  KILN_CHECK(im.channels == 1 || im.channels == 3, InvalidArgument, augment_op_name(op),
             " takes 1- or 3-channel images, not ", im.channels);
  if (augment_op_is_geometric(op)) return affine_nearest(im, p.grid);
  switch (op) {
    case AugmentOp::brightness:
      return adjust_brightness(im, p.ratio, p.rest);
    case AugmentOp::color:
      return adjust_saturation(im, p.ratio, p.rest);
    case AugmentOp::contrast:
      return adjust_contrast(im, p.ratio, p.rest);
    case AugmentOp::sharpness:
      return adjust_sharpness(im, p.ratio, p.rest);
    case AugmentOp::posterize:
      return posterize(im, p.bits);
    case AugmentOp::solarize:
      return solarize(im, p.bits);
    case AugmentOp::autocontrast:
      return autocontrast(im);
    case AugmentOp::equalize:
      return equalize(im);
    default:  // identity
      return;
  }
}

void apply_augment_op(Image& im, AugmentOp op, double mag) {
  KILN_CHECK(im.channels == 1 || im.channels == 3, InvalidArgument, augment_op_name(op),
             " takes 1- or 3-channel images, not ", im.channels);
  apply_augment_params(im, augment_op_params(op, mag, im.height, im.width));
}

float linspace_f32(double start, double end, int64_t steps, int64_t i) {
  const float a = static_cast<float>(start), b = static_cast<float>(end);
  if (steps == 1) return a;
  const float step = (b - a) / static_cast<float>(steps - 1);
  return i < steps / 2 ? a + step * static_cast<float>(i)
                       : b - step * static_cast<float>(steps - i - 1);
}

AutoAugmentPolicy parse_auto_augment(const std::string& name) {
  if (name == "ra") return AutoAugmentPolicy::rand_augment;
  if (name == "ta_wide") return AutoAugmentPolicy::trivial_augment_wide;
  KILN_FAIL(InvalidArgument, "--auto-augment '", name,
            "' is not a policy kiln has; use ra (RandAugment) or ta_wide (TrivialAugmentWide)");
}

AutoAugment::AutoAugment(AutoAugmentPolicy policy, int num_ops, int magnitude, int bins)
    : policy_(policy), num_ops_(num_ops), magnitude_(magnitude), bins_(bins) {
  KILN_CHECK(bins >= 2 && bins <= 1024, InvalidArgument,
             "auto-augment needs 2 to 1024 magnitude bins, got ", bins);
  if (policy == AutoAugmentPolicy::rand_augment) {
    KILN_CHECK(num_ops >= 0 && num_ops <= 64, InvalidArgument,
               "RandAugment applies 0 to 64 ops per image (--ra-num-ops), got ", num_ops);
    KILN_CHECK(magnitude >= 0 && magnitude < bins, InvalidArgument,
               "RandAugment's magnitude (--ra-magnitude) is a bin in 0..", bins - 1, ", got ",
               magnitude);
  }
}

bool AutoAugment::signed_op(AugmentOp op) {
  return op >= AugmentOp::shear_x && op <= AugmentOp::sharpness;
}

double AutoAugment::magnitude(AugmentOp op, int bin, int64_t h, int64_t w) const {
  const bool ra = policy_ == AutoAugmentPolicy::rand_augment;
  const int64_t n = bins_;
  switch (op) {
    case AugmentOp::shear_x:
    case AugmentOp::shear_y:
      return linspace_f32(0.0, ra ? 0.3 : 0.99, n, bin);
    case AugmentOp::translate_x:
      return linspace_f32(0.0, ra ? 150.0 / 331.0 * static_cast<double>(w) : 32.0, n, bin);
    case AugmentOp::translate_y:
      return linspace_f32(0.0, ra ? 150.0 / 331.0 * static_cast<double>(h) : 32.0, n, bin);
    case AugmentOp::rotate:
      return linspace_f32(0.0, ra ? 30.0 : 135.0, n, bin);
    case AugmentOp::brightness:
    case AugmentOp::color:
    case AugmentOp::contrast:
    case AugmentOp::sharpness:
      return linspace_f32(0.0, ra ? 0.9 : 0.99, n, bin);
    case AugmentOp::posterize: {
      // 8 - (arange(n) / ((n - 1) / 4 or 6)).round().int(), in float32, half to even.
      const float div = static_cast<float>(static_cast<double>(n - 1) / (ra ? 4.0 : 6.0));
      return 8.0 - std::nearbyint(static_cast<float>(bin) / div);
    }
    case AugmentOp::solarize:
      return linspace_f32(255.0, 0.0, n, bin);
    default:
      return 0.0;
  }
}

std::vector<std::pair<AugmentOp, double>> AutoAugment::draw(int64_t h, int64_t w, Rng& rng) const {
  std::vector<std::pair<AugmentOp, double>> ops;
  const bool ra = policy_ == AutoAugmentPolicy::rand_augment;
  for (int i = 0; i < (ra ? num_ops_ : 1); ++i) {
    const auto op = static_cast<AugmentOp>(rng.below(kAugmentOps));
    const bool scalar =
        op == AugmentOp::identity || op == AugmentOp::autocontrast || op == AugmentOp::equalize;
    // TrivialAugmentWide draws a bin only for ops with a magnitude table; then, for signed
    // ops, a coin for the sign (torch.randint(2)).
    int bin = magnitude_;
    if (!ra && !scalar) bin = static_cast<int>(rng.below(static_cast<uint64_t>(bins_)));
    double m = scalar ? 0.0 : magnitude(op, bin, h, w);
    if (signed_op(op) && rng.below(2) != 0) m = -m;
    ops.emplace_back(op, m);
  }
  return ops;
}

void AutoAugment::draw_augment(SampleAugment& a, int64_t h, int64_t w, Rng& rng) const {
  for (const auto& op : draw(h, w, rng)) a.ops.push_back(op);
}

void AutoAugment::apply(FloatImage& image, Rng& rng) const {
  KILN_CHECK(image.channels == 1 || image.channels == 3, InvalidArgument, describe(),
             " takes 1- or 3-channel images, not ", image.channels);
  const auto ops = draw(image.height, image.width, rng);
  Image im;
  im.height = image.height, im.width = image.width, im.channels = image.channels;
  im.pixels.resize(image.data.size());
  // The bytes a uint8 image would hold (the crop's output rounded, as PIL's).
  for (size_t i = 0; i < image.data.size(); ++i) {
    im.pixels[i] =
        static_cast<uint8_t>(std::lround(std::min(1.0f, std::max(0.0f, image.data[i])) * 255.0f));
  }
  for (const auto& [op, m] : ops) apply_augment_op(im, op, m);
  for (size_t i = 0; i < image.data.size(); ++i) {
    image.data[i] = static_cast<float>(im.pixels[i]) * (1.0f / 255.0f);
  }
}

std::string AutoAugment::describe() const {
  std::ostringstream os;
  if (policy_ == AutoAugmentPolicy::rand_augment) {
    os << "RandAugment(ops " << num_ops_ << ", magnitude " << magnitude_ << ", bins " << bins_
       << ")";
  } else {
    os << "TrivialAugmentWide(bins " << bins_ << ")";
  }
  return os.str();
}

}  // namespace kiln
