#include "kiln/data/transforms.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln {
namespace {

// Python's round(): half to even, which std::nearbyint does in the default rounding mode.
int64_t py_round(double v) {
  return static_cast<int64_t>(std::nearbyint(v));
}

// One axis of a bilinear resize: output o reads inputs i0 and i1 with weights (1-l, l).
struct Tap {
  int64_t i0, i1;
  float l;
};

// Half-pixel centres (align_corners=False), as ATen's area_pixel_compute_source_index for
// linear modes: src = (o + 0.5) * in / out - 0.5, clamped below at 0.
std::vector<Tap> taps(int64_t in, int64_t out) {
  std::vector<Tap> t(static_cast<size_t>(out));
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  for (int64_t o = 0; o < out; ++o) {
    const double src = std::max(0.0, (static_cast<double>(o) + 0.5) * scale - 0.5);
    const int64_t i0 = std::min(static_cast<int64_t>(src), in - 1);
    t[static_cast<size_t>(o)] = {i0, std::min(i0 + 1, in - 1),
                                 static_cast<float>(src - static_cast<double>(i0))};
  }
  return t;
}

// One output row: each output pixel blends two columns of two source rows. C is the channel
// count when known at compile time (1 or 3, the common cases, unrolled), 0 otherwise.
template <int C>
void resize_row(const float* r0, const float* r1, float wy, const std::vector<Tap>& tx,
                int64_t channels, float* out) {
  const int64_t c = C > 0 ? C : channels;
  for (const Tap& b : tx) {
    const float* a0 = r0 + b.i0 * c;
    const float* a1 = r0 + b.i1 * c;
    const float* b0 = r1 + b.i0 * c;
    const float* b1 = r1 + b.i1 * c;
    for (int64_t k = 0; k < c; ++k) {
      const float top = a0[k] + (a1[k] - a0[k]) * b.l;
      const float bot = b0[k] + (b1[k] - b0[k]) * b.l;
      out[k] = top + (bot - top) * wy;
    }
    out += c;
  }
}

// Bilinear resize of the box (inside the image) to h x w; crop-then-resize in one pass.
FloatImage resize_box(const FloatImage& img, const CropBox& box, int64_t h, int64_t w) {
  FloatImage out(h, w, img.channels);
  const std::vector<Tap> ty = taps(box.height, h);
  const std::vector<Tap> tx = taps(box.width, w);
  const int64_t c = img.channels;
  for (int64_t y = 0; y < h; ++y) {
    const Tap& a = ty[static_cast<size_t>(y)];
    const float* r0 = &img.data[static_cast<size_t>(((box.top + a.i0) * img.width + box.left) * c)];
    const float* r1 = &img.data[static_cast<size_t>(((box.top + a.i1) * img.width + box.left) * c)];
    float* o = &out.data[static_cast<size_t>(y * w * c)];
    if (c == 3) {
      resize_row<3>(r0, r1, a.l, tx, c, o);
    } else if (c == 1) {
      resize_row<1>(r0, r1, a.l, tx, c, o);
    } else {
      resize_row<0>(r0, r1, a.l, tx, c, o);
    }
  }
  return out;
}

void check_size(const char* what, int64_t h, int64_t w) {
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, what, " needs a positive size, got ", h, "x", w);
}

// CenterCrop's offset: larger than the image, zero padding split as torchvision does ((d)//2
// before); otherwise round((size - crop) / 2), half to even.
int64_t center_offset(int64_t size, int64_t crop) {
  return crop > size ? -((crop - size) / 2) : py_round(static_cast<double>(size - crop) / 2.0);
}

// The axis that maps `out` outputs onto the source pixels [start, start + len), read only there
// (PIL crops the box, then resizes it).
ResampleAxis box_axis(int64_t start, int64_t len, int64_t out, ResampleFilter filter) {
  ResampleAxis a;
  a.filter = filter;
  a.out = out;
  a.origin = static_cast<double>(start);
  a.scale = static_cast<double>(len) / static_cast<double>(out);
  a.lo = start, a.hi = start + len;
  a.valid_lo = 0, a.valid_hi = out;
  return a;
}

// Cropping c outputs starting at output `off` (negative: zero padding) of the axis.
ResampleAxis crop_axis(const ResampleAxis& a, int64_t off, int64_t c) {
  ResampleAxis r = a;
  r.out = c;
  r.origin = a.origin + static_cast<double>(off) * a.scale;
  r.valid_lo = std::min(c, std::max<int64_t>(0, a.valid_lo - off));
  r.valid_hi = std::max(r.valid_lo, std::min(c, a.valid_hi - off));
  return r;
}

// A crop of the current output; after a flip, the window is mirrored onto the unflipped output.
void compose_crop(SampleGeometry& g, int64_t top, int64_t left, int64_t h, int64_t w) {
  if (g.flip) left = g.x.out - w - left;
  g.y = crop_axis(g.y, top, h);
  g.x = crop_axis(g.x, left, w);
}

// Nothing but (perhaps) a flip so far: a resize may still compose into one resampling.
bool unresampled(const SampleGeometry& g) {
  return g.y == ResampleAxis::identity(g.src_h) && g.x == ResampleAxis::identity(g.src_w);
}

// The float counterpart of resample_u8 (same taps, no rounding).
template <int C>
void resample_rows(const FloatImage& img, const ResampleTaps& tx, int64_t r0, int64_t r1, bool flip,
                   std::vector<float>& rows) {
  const int64_t c = C > 0 ? C : img.channels;
  const int64_t out_w = static_cast<int64_t>(tx.count.size());
  rows.assign(static_cast<size_t>((r1 - r0) * out_w * c), 0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = &img.data[static_cast<size_t>(r * img.width * c)];
    float* dst = &rows[static_cast<size_t>((r - r0) * out_w * c)];
    for (int64_t x = 0; x < out_w; ++x) {
      float* d = dst + (flip ? out_w - 1 - x : x) * c;
      const int32_t n = tx.count[static_cast<size_t>(x)];
      const float* w = &tx.weight[static_cast<size_t>(x * tx.max_taps)];
      const float* s = src + static_cast<int64_t>(tx.first[static_cast<size_t>(x)]) * c;
      for (int32_t k = 0; k < n; ++k, s += c) {
        for (int64_t ch = 0; ch < c; ++ch) d[ch] += w[k] * s[ch];
      }
    }
  }
}

void clamp01(float& v) {
  v = std::min(1.0f, std::max(0.0f, v));
}

float gray_of(const float* p) {
  return 0.2989f * p[0] + 0.587f * p[1] + 0.114f * p[2];
}

void adjust_brightness(FloatImage& img, float f) {
  for (float& v : img.data) {
    v *= f;
    clamp01(v);
  }
}

void adjust_contrast(FloatImage& img, float f) {
  // Blend with the mean grey level of the whole image (torchvision's adjust_contrast).
  const int64_t pixels = img.height * img.width;
  double sum = 0.0;
  for (int64_t p = 0; p < pixels; ++p) {
    const float* px = &img.data[static_cast<size_t>(p * img.channels)];
    sum += img.channels == 3 ? gray_of(px) : px[0];
  }
  const float mean = static_cast<float>(sum / static_cast<double>(pixels));
  for (float& v : img.data) {
    v = f * v + (1.0f - f) * mean;
    clamp01(v);
  }
}

void adjust_saturation(FloatImage& img, float f) {
  if (img.channels == 1) return;  // nothing to saturate, as torchvision
  for (int64_t p = 0; p < img.height * img.width; ++p) {
    float* px = &img.data[static_cast<size_t>(p * 3)];
    const float g = gray_of(px);
    for (int k = 0; k < 3; ++k) {
      px[k] = f * px[k] + (1.0f - f) * g;
      clamp01(px[k]);
    }
  }
}

// torchvision's _rgb2hsv / _hsv2rgb, pixel by pixel.
void adjust_hue(FloatImage& img, float shift) {
  if (img.channels == 1) return;
  for (int64_t p = 0; p < img.height * img.width; ++p) {
    float* px = &img.data[static_cast<size_t>(p * 3)];
    const float r = px[0], g = px[1], b = px[2];
    const float maxc = std::max(r, std::max(g, b));
    const float minc = std::min(r, std::min(g, b));
    const bool eq = maxc == minc;
    const float cr = maxc - minc;
    const float s = cr / (eq ? 1.0f : maxc);
    const float div = eq ? 1.0f : cr;
    const float rc = (maxc - r) / div, gc = (maxc - g) / div, bc = (maxc - b) / div;
    float h = 0.0f;
    if (maxc == r) {
      h = bc - gc;
    } else if (maxc == g) {
      h = 2.0f + rc - bc;
    } else {
      h = 4.0f + gc - rc;
    }
    h = std::fmod(h / 6.0f + 1.0f, 1.0f);
    h = h + shift;
    h -= std::floor(h);  // Python's % 1.0: into [0, 1)
    const float v = maxc;
    const float i_f = std::floor(h * 6.0f);
    const float fr = h * 6.0f - i_f;
    const int i = static_cast<int>(i_f) % 6;
    float pp = v * (1.0f - s), q = v * (1.0f - s * fr), t = v * (1.0f - s * (1.0f - fr));
    clamp01(pp), clamp01(q), clamp01(t);
    const float rgb[6][3] = {{v, t, pp}, {q, v, pp}, {pp, v, t},
                             {pp, q, v}, {t, pp, v}, {v, pp, q}};
    px[0] = rgb[i][0], px[1] = rgb[i][1], px[2] = rgb[i][2];
  }
}

}  // namespace

FloatImage to_float_image(const Image& image) {
  FloatImage out(image.height, image.width, image.channels);
  for (size_t i = 0; i < out.data.size(); ++i) out.data[i] = image.pixels[i];
  return out;
}

FloatImage crop_image(const FloatImage& img, int64_t top, int64_t left, int64_t h, int64_t w) {
  FloatImage out(h, w, img.channels);
  const int64_t c = img.channels;
  // Copy the rows and columns where the window and the image overlap; the rest stays zero.
  const int64_t x0 = std::max<int64_t>(0, -left), x1 = std::min(w, img.width - left);
  if (x1 <= x0) return out;
  for (int64_t y = std::max<int64_t>(0, -top); y < std::min(h, img.height - top); ++y) {
    const float* src = &img.data[static_cast<size_t>(((top + y) * img.width + left + x0) * c)];
    std::copy(src, src + (x1 - x0) * c, &out.data[static_cast<size_t>((y * w + x0) * c)]);
  }
  return out;
}

FloatImage resample_float(const FloatImage& image, const SampleGeometry& g) {
  KILN_CHECK(image.height == g.src_h && image.width == g.src_w, InvalidArgument,
             "resample_float: the image is ", image.height, "x", image.width,
             " but the geometry refers to ", g.src_h, "x", g.src_w);
  const ResampleTaps ty = resample_taps(g.y, g.src_h);
  const ResampleTaps tx = resample_taps(g.x, g.src_w);
  int64_t r0 = g.src_h, r1 = 0;
  for (size_t i = 0; i < ty.count.size(); ++i) {
    if (ty.count[i] == 0) continue;
    r0 = std::min<int64_t>(r0, ty.first[i]);
    r1 = std::max<int64_t>(r1, ty.first[i] + ty.count[i]);
  }
  FloatImage out(g.y.out, g.x.out, image.channels);
  if (r1 <= r0) return out;
  std::vector<float> rows;
  if (image.channels == 3) {
    resample_rows<3>(image, tx, r0, r1, g.flip, rows);
  } else if (image.channels == 1) {
    resample_rows<1>(image, tx, r0, r1, g.flip, rows);
  } else {
    resample_rows<0>(image, tx, r0, r1, g.flip, rows);
  }
  const int64_t row = g.x.out * image.channels;
  for (int64_t y = 0; y < g.y.out; ++y) {
    const int32_t n = ty.count[static_cast<size_t>(y)];
    const float* w = &ty.weight[static_cast<size_t>(y * ty.max_taps)];
    float* o = &out.data[static_cast<size_t>(y * row)];
    for (int32_t k = 0; k < n; ++k) {
      const float* s =
          &rows[static_cast<size_t>((ty.first[static_cast<size_t>(y)] + k - r0) * row)];
      for (int64_t i = 0; i < row; ++i) o[i] += w[k] * s[i];
    }
  }
  return out;
}

FloatImage resize_bilinear(const FloatImage& image, int64_t h, int64_t w) {
  check_size("resize", h, w);
  return resize_box(image, {0, 0, image.height, image.width}, h, w);
}

void ToFloat::apply(FloatImage& image, Rng&) const {
  for (float& v : image.data) v *= 1.0f / 255.0f;
}

RandomResizedCrop::RandomResizedCrop(int64_t size, std::array<float, 2> scale,
                                     std::array<float, 2> ratio, ResampleFilter filter)
    : RandomResizedCrop(size, size, scale, ratio, filter) {}

RandomResizedCrop::RandomResizedCrop(int64_t height, int64_t width, std::array<float, 2> scale,
                                     std::array<float, 2> ratio, ResampleFilter filter)
    : height_(height), width_(width), scale_(scale), ratio_(ratio), filter_(filter) {
  check_size("RandomResizedCrop", height, width);
  KILN_CHECK(scale[0] > 0 && scale[0] <= scale[1] && scale[1] <= 1, InvalidArgument,
             "RandomResizedCrop scale must satisfy 0 < lo <= hi <= 1, got (", scale[0], ", ",
             scale[1], ")");
  KILN_CHECK(ratio[0] > 0 && ratio[0] <= ratio[1], InvalidArgument,
             "RandomResizedCrop ratio must satisfy 0 < lo <= hi, got (", ratio[0], ", ", ratio[1],
             ")");
}

CropBox RandomResizedCrop::sample_box(int64_t h, int64_t w, Rng& rng) const {
  const double area = static_cast<double>(h) * static_cast<double>(w);
  const double log_lo = std::log(ratio_[0]), log_hi = std::log(ratio_[1]);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_[0] + rng.uniform() * (scale_[1] - scale_[0]));
    const double aspect = std::exp(log_lo + rng.uniform() * (log_hi - log_lo));
    const int64_t cw = py_round(std::sqrt(target * aspect));
    const int64_t ch = py_round(std::sqrt(target / aspect));
    if (cw > 0 && cw <= w && ch > 0 && ch <= h) {
      const int64_t top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(h - ch + 1)));
      const int64_t left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(w - cw + 1)));
      return {top, left, ch, cw};
    }
  }
  // Fallback: the largest centred box within the ratio range.
  const double in_ratio = static_cast<double>(w) / static_cast<double>(h);
  int64_t cw = w, ch = h;
  if (in_ratio < ratio_[0]) {
    ch = py_round(static_cast<double>(cw) / ratio_[0]);
  } else if (in_ratio > ratio_[1]) {
    cw = py_round(static_cast<double>(ch) * ratio_[1]);
  }
  return {(h - ch) / 2, (w - cw) / 2, ch, cw};
}

void RandomResizedCrop::apply(FloatImage& image, Rng& rng) const {
  SampleGeometry g = SampleGeometry::identity(image.height, image.width);
  compose(g, rng);
  image = resample_float(image, g);
}

bool RandomResizedCrop::compose(SampleGeometry& g, Rng& rng) const {
  if (!unresampled(g)) return false;  // a second resampling: not one filter any more
  const CropBox b = sample_box(g.y.out, g.x.out, rng);
  g.y = box_axis(b.top, b.height, height_, filter_);
  g.x = box_axis(g.flip ? g.x.out - b.left - b.width : b.left, b.width, width_, filter_);
  return true;
}

std::string RandomResizedCrop::describe() const {
  std::ostringstream os;
  os << "RandomResizedCrop(" << height_ << "x" << width_ << ", scale " << scale_[0] << ".."
     << scale_[1] << ", ratio " << ratio_[0] << ".." << ratio_[1];
  if (filter_ != ResampleFilter::bilinear) os << ", " << filter_name(filter_);
  os << ")";
  return os.str();
}

RandomCrop::RandomCrop(int64_t height, int64_t width, int64_t padding)
    : height_(height), width_(width), padding_(padding) {
  check_size("RandomCrop", height, width);
  KILN_CHECK(padding >= 0, InvalidArgument, "RandomCrop padding must be >= 0, got ", padding);
}

void RandomCrop::apply(FloatImage& image, Rng& rng) const {
  const int64_t ph = image.height + 2 * padding_, pw = image.width + 2 * padding_;
  KILN_CHECK(ph >= height_ && pw >= width_, InvalidArgument, "RandomCrop(", height_, "x", width_,
             ", padding ", padding_, ") on a ", image.height, "x", image.width,
             " image: the crop is larger than the padded image; add padding or a Resize first");
  const int64_t top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(ph - height_ + 1)));
  const int64_t left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(pw - width_ + 1)));
  image = crop_image(image, top - padding_, left - padding_, height_, width_);
}

bool RandomCrop::compose(SampleGeometry& g, Rng& rng) const {
  // The same check and draws as apply(), on the current output's size.
  const int64_t ph = g.y.out + 2 * padding_, pw = g.x.out + 2 * padding_;
  KILN_CHECK(ph >= height_ && pw >= width_, InvalidArgument, "RandomCrop(", height_, "x", width_,
             ", padding ", padding_, ") on a ", g.y.out, "x", g.x.out,
             " image: the crop is larger than the padded image; add padding or a Resize first");
  const int64_t top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(ph - height_ + 1)));
  const int64_t left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(pw - width_ + 1)));
  compose_crop(g, top - padding_, left - padding_, height_, width_);
  return true;
}

std::string RandomCrop::describe() const {
  return "RandomCrop(" + std::to_string(height_) + "x" + std::to_string(width_) + ", pad " +
         std::to_string(padding_) + ")";
}

RandomHorizontalFlip::RandomHorizontalFlip(float p) : p_(p) {
  KILN_CHECK(p >= 0.0f && p <= 1.0f, InvalidArgument, "flip probability ", p, " is outside [0, 1]");
}

void RandomHorizontalFlip::apply(FloatImage& image, Rng& rng) const {
  if (!(rng.uniform() < p_)) return;
  const int64_t c = image.channels;
  for (int64_t y = 0; y < image.height; ++y) {
    float* row = &image.data[static_cast<size_t>(y * image.width * c)];
    for (int64_t a = 0, b = image.width - 1; a < b; ++a, --b) {
      std::swap_ranges(row + a * c, row + (a + 1) * c, row + b * c);
    }
  }
}

bool RandomHorizontalFlip::compose(SampleGeometry& g, Rng& rng) const {
  if (rng.uniform() < p_) g.flip = !g.flip;
  return true;
}

std::string RandomHorizontalFlip::describe() const {
  std::ostringstream os;
  os << "RandomHorizontalFlip(p " << p_ << ")";
  return os.str();
}

ColorJitter::ColorJitter(float brightness, float contrast, float saturation, float hue)
    : brightness_(brightness), contrast_(contrast), saturation_(saturation), hue_(hue) {
  KILN_CHECK(brightness >= 0 && contrast >= 0 && saturation >= 0, InvalidArgument,
             "ColorJitter brightness, contrast and saturation must be >= 0, got ", brightness, ", ",
             contrast, ", ", saturation);
  KILN_CHECK(hue >= 0 && hue <= 0.5f, InvalidArgument, "ColorJitter hue must be in [0, 0.5], got ",
             hue);
}

void ColorJitter::apply(FloatImage& image, Rng& rng) const {
  KILN_CHECK(image.channels == 1 || image.channels == 3, InvalidArgument,
             "ColorJitter takes 1- or 3-channel images, not ", image.channels);
  // A random order of the four adjustments (torch.randperm(4)), then the factors; a zero
  // strength draws nothing, as torchvision's None parameters.
  int order[4] = {0, 1, 2, 3};
  for (int i = 3; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<uint64_t>(i + 1))]);
  auto factor = [&](float strength) {
    const float lo = std::max(0.0f, 1.0f - strength), hi = 1.0f + strength;
    return lo + static_cast<float>(rng.uniform()) * (hi - lo);
  };
  const float b = brightness_ > 0 ? factor(brightness_) : 1.0f;
  const float c = contrast_ > 0 ? factor(contrast_) : 1.0f;
  const float s = saturation_ > 0 ? factor(saturation_) : 1.0f;
  const float h = hue_ > 0 ? -hue_ + static_cast<float>(rng.uniform()) * 2.0f * hue_ : 0.0f;
  for (int op : order) {
    if (op == 0 && brightness_ > 0) adjust_brightness(image, b);
    if (op == 1 && contrast_ > 0) adjust_contrast(image, c);
    if (op == 2 && saturation_ > 0) adjust_saturation(image, s);
    if (op == 3 && hue_ > 0) adjust_hue(image, h);
  }
}

std::string ColorJitter::describe() const {
  std::ostringstream os;
  os << "ColorJitter(brightness " << brightness_ << ", contrast " << contrast_ << ", saturation "
     << saturation_ << ", hue " << hue_ << ")";
  return os.str();
}

Normalize::Normalize(std::vector<float> mean, std::vector<float> std)
    : mean_(std::move(mean)), std_(std::move(std)) {
  KILN_CHECK(!mean_.empty() && mean_.size() == std_.size(), InvalidArgument,
             "Normalize needs one mean and one std per channel, got ", mean_.size(), " and ",
             std_.size());
  for (float s : std_) {
    KILN_CHECK(s > 0, InvalidArgument, "Normalize std must be > 0, got ", s);
    inv_std_.push_back(1.0f / s);
  }
}

void Normalize::apply(FloatImage& image, Rng&) const {
  const int64_t c = image.channels;
  KILN_CHECK(static_cast<size_t>(c) == mean_.size(), InvalidArgument, "Normalize has ",
             mean_.size(), " channel statistics but the image has ", c,
             " channels; give one mean and std per channel");
  float* p = image.data.data();
  for (int64_t i = 0; i < image.height * image.width; ++i, p += c) {
    for (int64_t k = 0; k < c; ++k)
      p[k] = (p[k] - mean_[static_cast<size_t>(k)]) * inv_std_[static_cast<size_t>(k)];
  }
}

std::string Normalize::describe() const {
  std::ostringstream os;
  os << "Normalize(mean";
  for (float m : mean_) os << " " << m;
  os << ", std";
  for (float s : std_) os << " " << s;
  os << ")";
  return os.str();
}

RandomErasing::RandomErasing(float p, std::array<float, 2> scale, std::array<float, 2> ratio,
                             float value)
    : p_(p), scale_(scale), ratio_(ratio), value_(value) {
  KILN_CHECK(p >= 0.0f && p <= 1.0f, InvalidArgument, "RandomErasing probability ", p,
             " is outside [0, 1]");
  KILN_CHECK(scale[0] >= 0 && scale[0] <= scale[1] && scale[1] <= 1, InvalidArgument,
             "RandomErasing scale must satisfy 0 <= lo <= hi <= 1, got (", scale[0], ", ", scale[1],
             ")");
  KILN_CHECK(ratio[0] > 0 && ratio[0] <= ratio[1], InvalidArgument,
             "RandomErasing ratio must satisfy 0 < lo <= hi, got (", ratio[0], ", ", ratio[1], ")");
  KILN_CHECK(std::isfinite(value), InvalidArgument, "RandomErasing value must be finite, got ",
             value);
}

CropBox RandomErasing::sample_box(int64_t h, int64_t w, Rng& rng) const {
  if (!(rng.uniform() < p_)) return {};
  const double area = static_cast<double>(h) * static_cast<double>(w);
  const double log_lo = std::log(ratio_[0]), log_hi = std::log(ratio_[1]);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_[0] + rng.uniform() * (scale_[1] - scale_[0]));
    const double aspect = std::exp(log_lo + rng.uniform() * (log_hi - log_lo));
    // Unlike RandomResizedCrop, the aspect is h / w here, and the box must be strictly smaller.
    const int64_t eh = py_round(std::sqrt(target * aspect));
    const int64_t ew = py_round(std::sqrt(target / aspect));
    if (!(eh < h && ew < w)) continue;
    const int64_t top = static_cast<int64_t>(rng.below(static_cast<uint64_t>(h - eh + 1)));
    const int64_t left = static_cast<int64_t>(rng.below(static_cast<uint64_t>(w - ew + 1)));
    return {top, left, eh, ew};
  }
  return {};
}

void RandomErasing::apply(FloatImage& image, Rng& rng) const {
  const CropBox b = sample_box(image.height, image.width, rng);
  const int64_t c = image.channels;
  for (int64_t y = b.top; y < b.top + b.height; ++y) {
    float* row = &image.data[static_cast<size_t>((y * image.width + b.left) * c)];
    std::fill(row, row + b.width * c, value_);
  }
}

void RandomErasing::draw_augment(SampleAugment& a, int64_t h, int64_t w, Rng& rng) const {
  const CropBox b = sample_box(h, w, rng);
  if (b.height > 0 && b.width > 0) a.erase = EraseBox{b.top, b.left, b.height, b.width, value_};
}

std::string RandomErasing::describe() const {
  std::ostringstream os;
  os << "RandomErasing(p " << p_ << ", scale " << scale_[0] << ".." << scale_[1] << ", ratio "
     << ratio_[0] << ".." << ratio_[1] << ", value " << value_ << ")";
  return os.str();
}

Resize::Resize(int64_t shorter_side, ResampleFilter filter)
    : shorter_(shorter_side), filter_(filter) {
  check_size("Resize", shorter_side, shorter_side);
}

void Resize::apply(FloatImage& image, Rng& rng) const {
  const int64_t h = image.height, w = image.width;
  SampleGeometry g = SampleGeometry::identity(h, w);
  compose(g, rng);
  image = resample_float(image, g);
}

bool Resize::compose(SampleGeometry& g, Rng&) const {
  if (!unresampled(g)) return false;
  const int64_t h = g.y.out, w = g.x.out;
  int64_t nh = shorter_, nw = shorter_;
  if (w <= h) {
    nh = static_cast<int64_t>(static_cast<double>(shorter_) * static_cast<double>(h) /
                              static_cast<double>(w));
  } else {
    nw = static_cast<int64_t>(static_cast<double>(shorter_) * static_cast<double>(w) /
                              static_cast<double>(h));
  }
  if (nh == h && nw == w) return true;
  // torchvision: the long side is int(size * long / short), truncated.
  g.y = box_axis(0, h, nh, filter_);
  g.x = box_axis(0, w, nw, filter_);
  return true;
}

std::string Resize::describe() const {
  const std::string f =
      filter_ == ResampleFilter::bilinear ? "" : std::string(", ") + filter_name(filter_);
  return "Resize(shorter side " + std::to_string(shorter_) + f + ")";
}

CenterCrop::CenterCrop(int64_t height, int64_t width) : height_(height), width_(width) {
  check_size("CenterCrop", height, width);
}

void CenterCrop::apply(FloatImage& image, Rng&) const {
  if (image.height == height_ && image.width == width_) return;
  image = crop_image(image, center_offset(image.height, height_),
                     center_offset(image.width, width_), height_, width_);
}

bool CenterCrop::compose(SampleGeometry& g, Rng&) const {
  if (g.y.out == height_ && g.x.out == width_) return true;
  compose_crop(g, center_offset(g.y.out, height_), center_offset(g.x.out, width_), height_, width_);
  return true;
}

std::string CenterCrop::describe() const {
  return "CenterCrop(" + std::to_string(height_) + "x" + std::to_string(width_) + ")";
}

Pipeline& Pipeline::add(std::shared_ptr<const Transform> transform) {
  KILN_CHECK(transform != nullptr, InvalidArgument, "Pipeline::add got a null transform");
  KILN_CHECK(!transform->needs_unit_range() || unit_range_, InvalidArgument, transform->describe(),
             " works on values in [0,1]; add ToFloat before it in the pipeline");
  unit_range_ = unit_range_ || transform->makes_unit_range();
  transforms_.push_back(std::move(transform));
  return *this;
}

FloatImage Pipeline::operator()(const Image& image, Rng& rng) const {
  FloatImage out = to_float_image(image);
  apply(out, rng);
  return out;
}

void Pipeline::apply(FloatImage& image, Rng& rng) const {
  for (const auto& t : transforms_) t->apply(image, rng);
}

bool Pipeline::geometric(std::string* why_not) const {
  return check_geometric(why_not, false);
}

bool Pipeline::geometric_with_augments(std::string* why_not) const {
  return check_geometric(why_not, true);
}

bool Pipeline::has_augments() const {
  for (const auto& t : transforms_) {
    if (t->value_augment() != Transform::ValueAugment::none) return true;
  }
  return false;
}

bool Pipeline::check_geometric(std::string* why_not, bool augments) const {
  auto no = [&](std::string why) {
    if (why_not) *why_not = std::move(why);
    return false;
  };
  using VA = Transform::ValueAugment;
  const Transform* resampled = nullptr;  // the crop or resize so far, if any
  const Transform* normalize = nullptr;
  const Transform* byte_ops = nullptr;  // the last value augmentation on bytes, if any
  const Transform* erase = nullptr;
  for (const auto& t : transforms_) {
    const Transform* p = t.get();
    const VA va = p->value_augment();
    if (erase) {
      return no(p->describe() + " follows " + erase->describe() +
                ": the uint8 / GPU path erases the finished sample; put " + erase->describe() +
                " last");
    }
    if (va == VA::erase && augments) {
      // After Normalize (or with none), as torchvision's reference has it: the backend erases
      // the normalised values.
      erase = p;
      continue;
    }
    if (normalize && va == VA::none) {
      return no(p->describe() + " follows " + normalize->describe() +
                ": the uint8 / GPU path normalises last; move Normalize to the end");
    }
    if (va == VA::byte_ops && augments) {
      if (normalize) {
        return no(p->describe() + " follows " + normalize->describe() +
                  ": the uint8 / GPU path augments the bytes before it normalises; move "
                  "Normalize after it");
      }
      byte_ops = p;
      continue;
    }
    const bool moves_pixels =
        dynamic_cast<const RandomResizedCrop*>(p) || dynamic_cast<const Resize*>(p) ||
        dynamic_cast<const CenterCrop*>(p) || dynamic_cast<const RandomCrop*>(p) ||
        dynamic_cast<const RandomHorizontalFlip*>(p);
    if (byte_ops && moves_pixels) {
      return no(p->describe() + " follows " + byte_ops->describe() +
                ": the uint8 / GPU path augments the resampled sample; crop, resize and flip "
                "before it");
    }
    if (dynamic_cast<const ToFloat*>(p) || dynamic_cast<const RandomHorizontalFlip*>(p)) continue;
    if (dynamic_cast<const Normalize*>(p)) {
      normalize = p;
      continue;
    }
    if (dynamic_cast<const RandomResizedCrop*>(p) || dynamic_cast<const Resize*>(p)) {
      if (resampled) {
        return no(p->describe() + " after " + resampled->describe() +
                  " resamples twice, which is not one resampling of the decoded image");
      }
      resampled = p;
      continue;
    }
    if (dynamic_cast<const CenterCrop*>(p) || dynamic_cast<const RandomCrop*>(p)) {
      resampled = resampled ? resampled : p;
      continue;
    }
    // Any other transform (ColorJitter, a value augmentation where none is asked for, or one
    // defined elsewhere): whatever its compose() says on an unresampled image.
    SampleGeometry g = SampleGeometry::identity(64, 64);
    Rng rng(0);
    if (va != VA::none || byte_ops || resampled || !p->compose(g, rng)) {
      return no(p->describe() +
                " changes pixel values or does not compose into the sample's geometry; the "
                "uint8 / GPU path only crops, resizes, flips and normalises" +
                (augments ? std::string(" (and runs AutoAugment and RandomErasing)") : ""));
    }
  }
  return true;
}

SampleGeometry Pipeline::geometry(int64_t h, int64_t w, Rng& rng) const {
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, "Pipeline::geometry needs an image size, got ", h,
             "x", w);
  SampleGeometry g = SampleGeometry::identity(h, w);
  for (const auto& t : transforms_) {
    if (!t->compose(g, rng)) {
      std::string why;
      geometric(&why);
      KILN_FAIL(InvalidArgument, "the pipeline ", describe(),
                " has no uint8 / GPU geometry: ", why.empty() ? t->describe() : why,
                "; use the float path (check Pipeline::geometric() first)");
    }
  }
  return g;
}

SampleGeometry Pipeline::geometry(int64_t h, int64_t w, Rng& rng, SampleAugment& augment) const {
  KILN_CHECK(h > 0 && w > 0, InvalidArgument, "Pipeline::geometry needs an image size, got ", h,
             "x", w);
  std::string why;
  KILN_CHECK(geometric_with_augments(&why), InvalidArgument, "the pipeline ", describe(),
             " has no uint8 / GPU geometry: ", why,
             "; use the float path (check Pipeline::geometric_with_augments() first)");
  augment = SampleAugment{};
  SampleGeometry g = SampleGeometry::identity(h, w);
  for (const auto& t : transforms_) {
    if (t->value_augment() != Transform::ValueAugment::none) {
      // The float path draws these on the image the transforms before them made: g's output.
      t->draw_augment(augment, g.out_h(), g.out_w(), rng);
    } else {
      KILN_CHECK(t->compose(g, rng), Internal, t->describe(), " passed geometric_with_augments()",
                 " but does not compose");
    }
  }
  return g;
}

InputNormalization Pipeline::normalization(int64_t channels) const {
  KILN_CHECK(channels >= 1, InvalidArgument, "normalization needs a channel count, got ", channels);
  // The float path gives (p * f - m) / s with f = 255^-(ToFloats before Normalize); on [0,1]
  // pixels that is (p / 255 - m / a) / (s / a) with a = 255 f (1 after one ToFloat).
  double a = 255.0;
  const Normalize* norm = nullptr;
  for (const auto& t : transforms_) {
    if (dynamic_cast<const ToFloat*>(t.get())) a /= 255.0;
    if (const auto* n = dynamic_cast<const Normalize*>(t.get())) norm = n;
  }
  InputNormalization out;
  for (int64_t k = 0; k < channels; ++k) {
    double m = 0, s = 1;
    if (norm) {
      KILN_CHECK(norm->mean().size() == static_cast<size_t>(channels), InvalidArgument,
                 norm->describe(), " has ", norm->mean().size(),
                 " channel statistics but the images have ", channels,
                 " channels; give one mean and std per channel");
      m = norm->mean()[static_cast<size_t>(k)];
      s = norm->std()[static_cast<size_t>(k)];
    }
    out.mean.push_back(static_cast<float>(m / a));
    out.std.push_back(static_cast<float>(s / a));
  }
  return out;
}

std::string Pipeline::describe() const {
  if (transforms_.empty()) return "(no transforms)";
  std::string s;
  for (const auto& t : transforms_) s += (s.empty() ? "" : " -> ") + t->describe();
  return s;
}

}  // namespace kiln
