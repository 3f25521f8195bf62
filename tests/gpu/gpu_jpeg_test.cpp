// The CUDA backend's input stage (jpeg_stage.h, input_stage.h): nvJPEG's pixels against
// libjpeg-turbo's (kiln::decode_jpeg) for baseline and progressive JPEGs of several sizes and
// subsamplings; the resample / flip / normalise kernel against a float64 reference of the
// sample_geometry.h contract; a mixed batch (baseline, progressive, grey, CMYK from the host,
// a corrupt file and a PNG that fall to host_decode, padding) against the host's pixels; and
// stage_batch_u8 against normalize_u8. Each runs with the hardware engines on and off
// (KILN_NVJPEG_HARDWARE), region decode on and off (KILN_NVJPEG_ROI), nvJPEG's memory cache
// off (KILN_NVJPEG_CACHE), and nvJPEG off
// (KILN_NVJPEG=0: everything through host_decode). Skipped without a GPU, and the nvJPEG cases
// where decodes_jpeg() says no (a build without nvJPEG).
#include <cuda_runtime.h>

// jpeglib.h needs FILE declared first.
// clang-format off
#include <cstdio>
#include <jpeglib.h>
// clang-format on

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/input_stage.h"
#include "gpu/gpu_test_util.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/input_batch.h"

namespace kiln::test {
namespace {

// ---- test images -------------------------------------------------------------------------

// Smooth content: the IDCTs of libjpeg-turbo and nvJPEG round differently, by a level or two on
// smooth images; sharp edges would mostly test the quantiser's ringing.
Image smooth_image(int64_t h, int64_t w, int64_t c, int seed) {
  Image im;
  im.height = h, im.width = w, im.channels = c;
  im.pixels.resize(static_cast<size_t>(h * w * c));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t k = 0; k < c; ++k) {
        const double v =
            128 + 70 * std::sin(0.045 * x + 0.9 * k + seed) * std::cos(0.035 * y + 0.3 * seed) +
            40.0 * (static_cast<double>(x) / w - 0.5) + 20.0 * (static_cast<double>(y) / h - 0.5);
        im.pixels[static_cast<size_t>((y * w + x) * c + k)] =
            static_cast<uint8_t>(std::lround(std::clamp(v, 0.0, 255.0)));
      }
    }
  }
  return im;
}

// A libjpeg encoder with the choices kiln::encode_jpeg does not offer: luma sampling factors
// (2x2 = 4:2:0, 2x1 = 4:2:2, 1x1 = 4:4:4) and progressive scans.
std::vector<uint8_t> encode_test_jpeg(const Image& im, int quality, int h_samp, int v_samp,
                                      bool progressive) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = static_cast<JDIMENSION>(im.width);
  c.image_height = static_cast<JDIMENSION>(im.height);
  c.input_components = static_cast<int>(im.channels);
  c.in_color_space = im.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (im.channels == 3) {
    c.comp_info[0].h_samp_factor = h_samp, c.comp_info[0].v_samp_factor = v_samp;
    for (int k = 1; k < 3; ++k) c.comp_info[k].h_samp_factor = c.comp_info[k].v_samp_factor = 1;
  }
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(
        &im.pixels[static_cast<size_t>(c.next_scanline * im.width * im.channels)]);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::vector<uint8_t> out(buf, buf + size);
  std::free(buf);
  return out;
}

// ---- the float64 reference of sample_geometry.h --------------------------------------------

ResampleAxis make_axis(int64_t out, double origin, double scale, int64_t lo, int64_t hi,
                       int64_t vlo, int64_t vhi) {
  ResampleAxis a;
  a.out = out, a.origin = origin, a.scale = scale, a.lo = lo, a.hi = hi, a.valid_lo = vlo,
  a.valid_hi = vhi;
  return a;
}
ResampleAxis identity_axis(int64_t n) {
  return make_axis(n, 0, 1, 0, n, 0, n);
}
// RandomResizedCrop: PIL crops [lo, lo + len) then resizes it to `out`.
ResampleAxis crop_axis(int64_t lo, int64_t len, int64_t out) {
  return make_axis(out, static_cast<double>(lo),
                   static_cast<double>(len) / static_cast<double>(out), lo, lo + len, 0, out);
}
SampleGeometry geometry(int64_t h, int64_t w, ResampleAxis y, ResampleAxis x, bool flip) {
  SampleGeometry g;
  g.src_h = h, g.src_w = w, g.y = y, g.x = x, g.flip = flip;
  return g;
}

// Per output of an axis: the source pixels and their normalised weights (double), straight
// from the contract: centre origin + (i + 0.5) scale, triangle of width max(scale, 1) over
// [lo, hi), PIL's rounding of the support's ends; pixels outside the image read 0.
std::vector<std::vector<std::pair<int64_t, double>>> ref_taps(const ResampleAxis& a) {
  std::vector<std::vector<std::pair<int64_t, double>>> taps(static_cast<size_t>(a.out));
  for (int64_t i = std::max<int64_t>(0, a.valid_lo); i < std::min(a.out, a.valid_hi); ++i) {
    const double support = std::max(a.scale, 1.0);
    const double centre = a.origin + (static_cast<double>(i) + 0.5) * a.scale;
    const int64_t j0 = std::max(a.lo, static_cast<int64_t>(std::floor(centre - support + 0.5)));
    const int64_t j1 = std::min(a.hi, static_cast<int64_t>(std::floor(centre + support + 0.5)));
    double sum = 0;
    auto& t = taps[static_cast<size_t>(i)];
    for (int64_t j = j0; j < j1; ++j) {
      const double w =
          std::max(0.0, 1.0 - std::fabs((static_cast<double>(j) + 0.5 - centre) / support));
      t.emplace_back(j, w);
      sum += w;
    }
    if (sum <= 0) {
      t.clear();
      continue;
    }
    for (auto& [j, w] : t) w /= sum;
  }
  return taps;
}

// The sample's pixel values (0..255, not rounded) in output order, flip applied.
std::vector<double> ref_resample(const Image& im, const SampleGeometry& g) {
  const auto ty = ref_taps(g.y), tx = ref_taps(g.x);
  const int64_t c = im.channels;
  std::vector<double> out(static_cast<size_t>(g.out_h() * g.out_w() * c), 0.0);
  for (int64_t oy = 0; oy < g.out_h(); ++oy) {
    for (int64_t ox = 0; ox < g.out_w(); ++ox) {
      const int64_t sx = g.flip ? g.out_w() - 1 - ox : ox;
      for (int64_t k = 0; k < c; ++k) {
        double v = 0;
        for (const auto& [jy, wy] : ty[static_cast<size_t>(oy)]) {
          if (jy < 0 || jy >= im.height) continue;
          for (const auto& [jx, wx] : tx[static_cast<size_t>(sx)]) {
            if (jx < 0 || jx >= im.width) continue;
            v += wy * wx * im.at(jy, jx, k);
          }
        }
        out[static_cast<size_t>((oy * g.out_w() + ox) * c + k)] = v;
      }
    }
  }
  return out;
}
std::vector<uint8_t> round_u8(const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = static_cast<uint8_t>(std::lround(std::clamp(v[i], 0.0, 255.0)));
  return out;
}

// ---- a program with staged input slots -----------------------------------------------------

// Input slots A and B of n x h x w x c in `dtype` (F32 today; F16 is handled too), and the
// transfer phases that read them, compiled on the CUDA backend made under the current switches.
struct Slots {
  OpHarness h{/*amp=*/true};
  TensorId img[2]{}, lab[2]{};
  Slots(int64_t n, int64_t hh, int64_t w, int64_t c, DType dtype = DType::F32,
        const Switches& switches = Switches::from_environment()) {
    Program& p = h.program();
    p.train.clear();
    for (int s = 0; s < 2; ++s) {
      const Region r = s == 0 ? Region::input_a : Region::input_b;
      img[s] = h.tensor(s == 0 ? "img_a" : "img_b", {n * hh * w * c}, r, dtype);
      lab[s] = h.tensor(s == 0 ? "lab_a" : "lab_b", {n}, r, DType::I32);
      p.io.staged_images[static_cast<size_t>(s)] = img[s];
      p.io.staged_labels[static_cast<size_t>(s)] = lab[s];
    }
    const DType other = dtype == DType::F32 ? DType::F16 : DType::F32;
    const TensorId input = h.tensor("input", {n * hh * w * c}, Region::features, other);
    const TensorId labels = h.tensor("labels", {n}, Region::aux, DType::I32);
    const TensorId sum = h.tensor("sum", {n * hh * w * c}, Region::features, other);
    for (int s = 0; s < 2; ++s) {
      p.train.push_back(Phase{PhaseKind::transfer, s == 0 ? "transfer_a" : "transfer_b", 2, {}});
      h.node(OpKind::cast, {img[s]}, {input});
      h.node(OpKind::copy, {lab[s]}, {labels});
    }
    p.train.push_back(Phase{PhaseKind::forward_backward, "forward_backward", 0, {}});
    h.node(OpKind::add, {input, input}, {sum});
    h.compile(make_backend("cuda", switches));
  }
  Backend& backend() { return h.backend(); }
  std::vector<float> images(int s) { return h.read(img[s]); }
  std::vector<int32_t> labels(int s) { return h.read_i32(lab[s]); }
};

InputNormalization imagenet_norm(int64_t c) {
  if (c == 1) return {{0.449f}, {0.226f}};
  return {{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}};
}
// mean 0, std 1/255: the slot holds the pixel values themselves.
InputNormalization identity_norm(int64_t c) {
  return {std::vector<float>(static_cast<size_t>(c), 0.0f),
          std::vector<float>(static_cast<size_t>(c), 1.0f / 255.0f)};
}

struct DecodeSwitches {
  const char* name;
  const char* nvjpeg;
  const char* hardware;
  const char* roi;
  const char* cache;
};
const DecodeSwitches kSwitches[] = {
    {"Defaults", "1", "1", "1", "1"}, {"NoHardware", "1", "0", "1", "1"},
    {"NoRoi", "1", "1", "0", "1"},    {"NoCache", "1", "1", "1", "0"},
    {"NoNvjpeg", "0", "1", "1", "1"},
};

class GpuJpeg : public ::testing::TestWithParam<DecodeSwitches> {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
    const DecodeSwitches& s = GetParam();
    switches_.set("nvjpeg", s.nvjpeg, "KILN_NVJPEG");
    switches_.set("nvjpeg_hardware", s.hardware, "KILN_NVJPEG_HARDWARE");
    switches_.set("nvjpeg_roi", s.roi, "KILN_NVJPEG_ROI");
    switches_.set("nvjpeg_cache", s.cache, "KILN_NVJPEG_CACHE");
  }
  bool nvjpeg_on() const { return std::string(GetParam().nvjpeg) == "1"; }
  bool hardware_off() const { return std::string(GetParam().hardware) == "0"; }
  // nvJPEG must be there for the cases that test it (not for KILN_NVJPEG=0).
  bool skip_without_nvjpeg(Backend& b) {
    std::string why;
    if (nvjpeg_on() && !b.decodes_jpeg(&why)) return true;
    if (!nvjpeg_on()) {
      EXPECT_FALSE(b.decodes_jpeg(&why)) << "KILN_NVJPEG=0 must turn the decoder off";
    }
    return false;
  }
  Switches switches_ = Switches::from_environment();
};

// Tolerance of nvJPEG against libjpeg-turbo, in levels of 255: both implement the JPEG spec's
// IDCT (ISO 10918's accuracy bound: within 1 of the exact IDCT per sample), but round
// differently, and the colour conversion rounds again: +-2 per pixel is common, 4 a bound on
// smooth content. Chroma upsampling (4:2:0, 4:2:2) differs more: libjpeg-turbo's fancy
// (triangle) upsampling against nvJPEG's own, so subsampled images get 8 and a mean of 1.5.
struct DecodeTol {
  double max_diff, mean_diff;
};
DecodeTol decode_tol(int h_samp, int v_samp) {
  return h_samp * v_samp == 1 ? DecodeTol{4, 0.5} : DecodeTol{8, 1.5};
}

struct Encoded {
  std::string name;
  std::vector<uint8_t> bytes;
  int h_samp = 1, v_samp = 1;
  bool progressive = false;
  int64_t channels = 3;
};

// nvJPEG's pixels against libjpeg-turbo's: an identity geometry (scale 1) and mean 0, std
// 1/255 make the slot hold the decoded pixels as they are.
TEST_P(GpuJpeg, DecodesLikeLibjpegTurbo) {
  const std::vector<std::pair<int64_t, int64_t>> sizes = {
      {48, 64}, {250, 333}, {375, 500}, {17, 23}};
  for (const auto& [h, w] : sizes) {
    std::vector<Encoded> files;
    const Image rgb = smooth_image(h, w, 3, static_cast<int>(h));
    for (const auto& [hs, vs] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {2, 2}}) {
      for (bool prog : {false, true}) {
        files.push_back(
            {"rgb_" + std::to_string(hs) + "x" + std::to_string(vs) + (prog ? "_progressive" : ""),
             encode_test_jpeg(rgb, 90, hs, vs, prog), hs, vs, prog, 3});
      }
    }
    const Image grey = smooth_image(h, w, 1, 7);
    files.push_back({"grey", encode_test_jpeg(grey, 90, 1, 1, false), 1, 1, false, 1});
    files.push_back({"grey_progressive", encode_test_jpeg(grey, 90, 1, 1, true), 1, 1, true, 1});
    const int64_t n = static_cast<int64_t>(files.size());
    for (int64_t out_c : {int64_t{3}, int64_t{1}}) {
      Slots slots(n, h, w, out_c, DType::F32, switches_);
      if (skip_without_nvjpeg(slots.backend())) GTEST_SKIP() << "this build or GPU has no nvJPEG";
      EncodedBatch b;
      b.size = b.batch = n, b.height = h, b.width = w, b.channels = out_c;
      for (int64_t k = 0; k < n; ++k) {
        b.images.push_back({files[static_cast<size_t>(k)].bytes,
                            geometry(h, w, identity_axis(h), identity_axis(w), false),
                            files[static_cast<size_t>(k)].name});
        b.labels.push_back(static_cast<int32_t>(k));
      }
      b.host_decode = [&](int64_t k, uint8_t* out, int32_t*) {
        const Image im = decode_jpeg(b.images[static_cast<size_t>(k)].bytes.data(),
                                     b.images[static_cast<size_t>(k)].bytes.size(), out_c, "test");
        std::copy(im.pixels.begin(), im.pixels.end(), out);
      };
      slots.backend().stage_batch_encoded(0, b, identity_norm(out_c));
      const std::vector<float> got = slots.images(0);
      const int64_t per = h * w * out_c;
      for (int64_t k = 0; k < n; ++k) {
        const Encoded& f = files[static_cast<size_t>(k)];
        const Image want = decode_jpeg(f.bytes.data(), f.bytes.size(), out_c, f.name);
        // To grey from colour: nvJPEG's Y plane against libjpeg's luma of its RGB, one more
        // rounding.
        DecodeTol tol = decode_tol(f.h_samp, f.v_samp);
        if (out_c == 1 && f.channels == 3) tol.max_diff += 1, tol.mean_diff += 0.5;
        double worst = 0, sum = 0;
        for (int64_t i = 0; i < per; ++i) {
          const double d = std::fabs(got[static_cast<size_t>(k * per + i)] -
                                     want.pixels[static_cast<size_t>(i)]);
          worst = std::max(worst, d);
          sum += d;
        }
        EXPECT_LE(worst, tol.max_diff)
            << f.name << " " << h << "x" << w << " to " << out_c << " channels";
        EXPECT_LE(sum / static_cast<double>(per), tol.mean_diff) << f.name << " " << h << "x" << w;
      }
      EXPECT_EQ(slots.labels(0), b.labels);
      const DecodeCounters dc = slots.backend().decode_counters();
      if (nvjpeg_on()) {
        EXPECT_EQ(dc.host, 0) << "every test image is one nvJPEG decodes";
        EXPECT_EQ(dc.hardware + dc.gpu_hybrid, n);
        // Progressive scans are never the engines'.
        EXPECT_GE(dc.gpu_hybrid, 4);
        if (hardware_off()) {
          EXPECT_EQ(dc.hardware, 0);
        }
      } else {
        EXPECT_EQ(dc.host, n);
      }
    }
  }
}

// A mixed batch against the host path: every sample equals the host decoder's pixels resampled
// by the float64 reference (within the decode tolerance), the host-decoded ones exactly.
TEST_P(GpuJpeg, MixedBatchMatchesTheHostPath) {
  const int64_t H = 56, W = 48, C = 3, batch = 9;
  const Image a = smooth_image(375, 500, 3, 1), p = smooth_image(333, 250, 3, 2),
              g = smooth_image(300, 400, 1, 3);
  const Image cmyk_src = smooth_image(120, 160, 4, 4);
  struct Item {
    std::string name;
    std::vector<uint8_t> bytes;
    SampleGeometry geom;
    bool host = false;  // the test's host_decode supplies it (cmyk via host_pixels, corrupt, png)
  };
  std::vector<Item> items;
  items.push_back({"baseline_420", encode_test_jpeg(a, 90, 2, 2, false),
                   geometry(375, 500, crop_axis(40, 200, H), crop_axis(100, 260, W), false)});
  items.push_back({"progressive_444", encode_test_jpeg(p, 90, 1, 1, true),
                   geometry(333, 250, crop_axis(10, 300, H), crop_axis(5, 240, W), true)});
  items.push_back(
      {"grey", encode_test_jpeg(g, 90, 1, 1, false),
       geometry(300, 400, crop_axis(150, 30, H), crop_axis(200, 20, W), false)});  // upscaling
  items.push_back({"baseline_422_flip", encode_test_jpeg(a, 85, 2, 1, false),
                   geometry(375, 500, crop_axis(0, 375, H), crop_axis(0, 500, W), true)});
  // CMYK: the loader decodes it (host_pixels); empty bytes say so.
  const std::vector<uint8_t> cmyk = encode_jpeg(cmyk_src, 90);
  items.push_back(
      {"cmyk", {}, geometry(120, 160, crop_axis(0, 120, H), crop_axis(20, 120, W), false), true});
  // Truncated: the host decoder refuses it and the dataset's next good file takes its place.
  std::vector<uint8_t> cut = encode_test_jpeg(a, 90, 2, 2, false);
  cut.resize(cut.size() / 2);
  items.push_back({"truncated", cut,
                   geometry(375, 500, crop_axis(0, 375, H), crop_axis(0, 500, W), false), true});
  // A PNG named .jpg: not a JPEG, decoded on the host.
  items.push_back({"png", encode_png(smooth_image(64, 80, 3, 5)),
                   geometry(64, 80, crop_axis(4, 56, H), crop_axis(8, 48, W), false), true});
  const int64_t size = static_cast<int64_t>(items.size());
  ASSERT_LT(size, batch);  // the rest is padding

  const Image replacement = smooth_image(60, 50, 3, 9);
  const SampleGeometry replacement_geom =
      geometry(60, 50, crop_axis(2, 56, H), crop_axis(1, 48, W), false);
  EncodedBatch b;
  b.size = size, b.batch = batch, b.height = H, b.width = W, b.channels = C;
  b.host_pixels.assign(static_cast<size_t>(batch * H * W * C), 0);
  for (int64_t k = 0; k < size; ++k) {
    const Item& it = items[static_cast<size_t>(k)];
    b.images.push_back({it.bytes, it.geom, it.name});
  }
  for (int64_t k = 0; k < batch; ++k)
    b.labels.push_back(k < size ? static_cast<int32_t>(10 + k) : -1);
  const auto cmyk_pixels =
      round_u8(ref_resample(decode_jpeg(cmyk.data(), cmyk.size(), 3, "cmyk"), items[4].geom));
  std::copy(cmyk_pixels.begin(), cmyk_pixels.end(), b.host_pixels.begin() + 4 * H * W * C);
  // The loader's host decode: decode_image + the reference resample, rounded to bytes; a file
  // that does not decode is replaced by `replacement`, label 99.
  std::vector<std::vector<uint8_t>> host_out(static_cast<size_t>(batch));
  b.host_decode = [&](int64_t k, uint8_t* out, int32_t* label) {
    const EncodedImage& im = b.images[static_cast<size_t>(k)];
    std::vector<uint8_t> px;
    try {
      px = round_u8(
          ref_resample(decode_image(im.bytes.data(), im.bytes.size(), C, im.name), im.geometry));
    } catch (const Error&) {
      px = round_u8(ref_resample(replacement, replacement_geom));
      *label = 99;
    }
    std::copy(px.begin(), px.end(), out);
    host_out[static_cast<size_t>(k)] = px;
  };

  Slots slots(batch, H, W, C, DType::F32, switches_);
  if (skip_without_nvjpeg(slots.backend())) GTEST_SKIP() << "this build or GPU has no nvJPEG";
  const InputNormalization norm = imagenet_norm(C);
  for (int round = 0; round < 2; ++round) {  // twice: the second batch reuses every buffer
    const int slot = round;
    slots.backend().stage_batch_encoded(slot, b, norm);
    const std::vector<float> got = slots.images(slot);
    const int64_t per = H * W * C;
    for (int64_t k = 0; k < batch; ++k) {
      const float* s = got.data() + k * per;
      if (k >= size) {
        for (int64_t i = 0; i < per; ++i) ASSERT_EQ(s[i], 0.0f) << "padding sample " << k;
        continue;
      }
      const Item& it = items[static_cast<size_t>(k)];
      if (!host_out[static_cast<size_t>(k)].empty() || k == 4) {
        // From host bytes: exactly the host's normalisation of them.
        const std::vector<uint8_t>& px = k == 4 ? cmyk_pixels : host_out[static_cast<size_t>(k)];
        std::vector<float> want(static_cast<size_t>(per));
        normalize_u8(px.data(), H * W, norm, want.data());
        for (int64_t i = 0; i < per; ++i)
          ASSERT_EQ(s[i], want[static_cast<size_t>(i)]) << it.name << " value " << i;
        continue;
      }
      ASSERT_FALSE(it.host) << it.name << " should have gone through host_decode";
      const Image ref = decode_jpeg(it.bytes.data(), it.bytes.size(), C, it.name);
      const std::vector<double> want = ref_resample(ref, it.geom);
      // Resampling averages the decoders' differences, so the decode tolerance bounds them.
      const DecodeTol tol =
          it.name == "progressive_444" || it.name == "grey" ? decode_tol(1, 1) : decode_tol(2, 2);
      double worst = 0, sum = 0;
      for (int64_t i = 0; i < per; ++i) {
        const int64_t c = i % C;
        const double sd = norm.std[static_cast<size_t>(c)],
                     mean = norm.mean[static_cast<size_t>(c)];
        const double levels = (static_cast<double>(s[i]) * sd + mean) * 255.0;  // back to 0..255
        const double d = std::fabs(levels - want[static_cast<size_t>(i)]);
        worst = std::max(worst, d);
        sum += d;
      }
      EXPECT_LE(worst, tol.max_diff + 0.01) << it.name;
      EXPECT_LE(sum / static_cast<double>(per), tol.mean_diff) << it.name;
    }
    std::vector<int32_t> want_labels = b.labels;
    want_labels[5] = 99;  // the truncated file's replacement
    EXPECT_EQ(slots.labels(slot), want_labels);
    const DecodeCounters dc = slots.backend().decode_counters();
    const int64_t rounds = round + 1;
    if (nvjpeg_on()) {
      EXPECT_EQ(dc.host, 3 * rounds) << "cmyk (host_pixels), truncated and png";
      EXPECT_EQ(dc.hardware + dc.gpu_hybrid, 4 * rounds);
      EXPECT_GE(dc.gpu_hybrid, rounds) << "the progressive file";
      if (hardware_off()) {
        EXPECT_EQ(dc.hardware, 0);
      }
    } else {
      EXPECT_EQ(dc.host, size * rounds);
      EXPECT_EQ(dc.hardware + dc.gpu_hybrid, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Switches, GpuJpeg, ::testing::ValuesIn(kSwitches),
                         [](const ::testing::TestParamInfo<DecodeSwitches>& i) {
                           return std::string(i.param.name);
                         });

// ---- the resample kernel alone ---------------------------------------------------------------

// launch_stage_samples over known bytes against the float64 reference: RandomResizedCrop-like
// boxes (down and up), Resize + CenterCrop (a crop larger than the image pads), RandomCrop with
// padding, flips, a window decoded from the middle of an image, a padding sample. F32 within
// 1e-4 (float weights and sums: ~1e-6 of 255 levels, /255/std); F16 within its rounding, 2^-10
// of the value, plus that.
TEST(GpuInputKernel, ResampleMatchesFloat64Reference) {
  KILN_REQUIRE_GPU();
  const int64_t H = 40, W = 36;
  for (int64_t C : {int64_t{3}, int64_t{1}}) {
    std::vector<Image> src = {smooth_image(97, 131, C, 1), smooth_image(30, 25, C, 2),
                              smooth_image(40, 36, C, 3), smooth_image(300, 200, C, 4),
                              smooth_image(64, 64, C, 5)};
    // Add a little detail, so a wrong tap shows.
    for (Image& im : src) {
      for (size_t i = 0; i < im.pixels.size(); i += 7)
        im.pixels[i] = static_cast<uint8_t>(im.pixels[i] ^ 0x5a);
    }
    std::vector<SampleGeometry> geo = {
        geometry(97, 131, crop_axis(10, 70, H), crop_axis(20, 90, W), false),  // down, RRC
        geometry(30, 25, crop_axis(3, 12, H), crop_axis(2, 9, W), true),       // up x3-4, flipped
        // RandomCrop(pad 4): origin -4 + offset, one source pixel per output; padding reads 0.
        geometry(40, 36, make_axis(H, -3, 1, -4, 44, 0, H), make_axis(W, -1, 1, -4, 40, 0, W),
                 true),
        // Resize(shorter 32) + CenterCrop(40 x 36): the resized 48 x 32 crop is padded in x.
        geometry(300, 200, make_axis(H, 4 * 6.25, 6.25, 0, 300, 0, H),
                 make_axis(W, -2 * 6.25, 6.25, 0, 200, 2, W - 2), false),
        // Decoded as a window (rows 8.., columns 16..: what a region decode gives) whose box
        // lies inside it, so its taps read nothing the window lacks.
        geometry(64, 64, crop_axis(10, 50, H), crop_axis(20, 40, W), false),
    };
    const int64_t n = static_cast<int64_t>(src.size()) + 1;  // + a padding sample
    const InputNormalization norm = imagenet_norm(C);
    const cuda::NormParams np = cuda::make_norm_params(norm, C, "test");
    std::vector<uint8_t*> dev(src.size(), nullptr);
    std::vector<cuda::SampleDesc> descs(static_cast<size_t>(n));
    for (size_t i = 0; i < src.size(); ++i) {
      const Image& im = src[i];
      cuda::SampleDesc d;
      d.y = cuda::axis_desc(geo[i].y, im.height);
      d.x = cuda::axis_desc(geo[i].x, im.width);
      d.flip = geo[i].flip;
      const int64_t top = i + 1 == src.size() ? 8 : 0, left = i + 1 == src.size() ? 16 : 0;
      const int64_t wh = im.height - top, ww = im.width - left;
      std::vector<uint8_t> win(static_cast<size_t>(wh * ww * C));
      for (int64_t y = 0; y < wh; ++y) {
        std::copy_n(&im.pixels[static_cast<size_t>(((y + top) * im.width + left) * C)], ww * C,
                    &win[static_cast<size_t>(y * ww * C)]);
      }
      ASSERT_EQ(cudaMalloc(&dev[i], win.size()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dev[i], win.data(), win.size(), cudaMemcpyHostToDevice), cudaSuccess);
      d.src = dev[i];
      d.pitch = ww * C;
      d.y.win_lo = static_cast<int32_t>(top), d.y.win_n = static_cast<int32_t>(wh);
      d.x.win_lo = static_cast<int32_t>(left), d.x.win_n = static_cast<int32_t>(ww);
      descs[i] = d;
    }
    descs.back().zero = 1;
    {
      int64_t y0, y1, x0, x1;
      cuda::axis_span(descs[4].y, &y0, &y1);
      cuda::axis_span(descs[4].x, &x0, &x1);
      ASSERT_GE(y0, 8);
      ASSERT_GE(x0, 16);
    }
    cuda::SampleDesc* d_descs = nullptr;
    ASSERT_EQ(cudaMalloc(&d_descs, descs.size() * sizeof(cuda::SampleDesc)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_descs, descs.data(), descs.size() * sizeof(cuda::SampleDesc),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    for (DType dt : {DType::F32, DType::F16}) {
      const int64_t count = n * H * W * C;
      void* out = nullptr;
      ASSERT_EQ(cudaMalloc(&out, static_cast<size_t>(count) * dtype_size(dt)), cudaSuccess);
      cuda::launch_stage_samples(d_descs, n, H, W, np, out, dt, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> got(static_cast<size_t>(count));
      if (dt == DType::F32) {
        ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      } else {
        std::vector<uint16_t> h16(got.size());
        ASSERT_EQ(cudaMemcpy(h16.data(), out, h16.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        for (size_t i = 0; i < got.size(); ++i) got[i] = half_to_float(h16[i]);
      }
      cudaFree(out);
      const int64_t per = H * W * C;
      for (size_t i = 0; i < src.size(); ++i) {
        const std::vector<double> want = ref_resample(src[i], geo[i]);
        double worst = 0;
        for (int64_t j = 0; j < per; ++j) {
          const int64_t c = j % C;
          const double v =
              (want[static_cast<size_t>(j)] / 255.0 - norm.mean[static_cast<size_t>(c)]) /
              norm.std[static_cast<size_t>(c)];
          const double tol = 1e-4 + (dt == DType::F16 ? std::fabs(v) / 1024.0 : 0.0);
          const double e =
              std::fabs(got[static_cast<size_t>(static_cast<int64_t>(i) * per + j)] - v);
          worst = std::max(worst, e / tol);
        }
        EXPECT_LE(worst, 1.0) << "sample " << i << " channels " << C << " " << dtype_name(dt)
                              << " (error / tolerance)";
      }
      for (int64_t j = 0; j < per; ++j)
        ASSERT_EQ(got[static_cast<size_t>((n - 1) * per + j)], 0.0f);
    }
    cudaFree(d_descs);
    for (uint8_t* p : dev) cudaFree(p);
  }
}

// stage_batch_u8 moves bytes and normalises on the device: the same floats as normalize_u8
// (bit for bit: no FMA contraction), so the same as stage_batch of the host's floats.
TEST(GpuInputKernel, StageBatchU8EqualsHostNormalisation) {
  KILN_REQUIRE_GPU();
  const int64_t N = 5, H = 7, W = 9, C = 3;
  const InputNormalization norm = imagenet_norm(C);
  std::vector<uint8_t> px(static_cast<size_t>(N * H * W * C));
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  std::vector<float> want(px.size());
  normalize_u8(px.data(), N * H * W, norm, want.data());
  const std::vector<int32_t> labels = {3, 1, 4, 1, 5};
  {
    Slots slots(N, H, W, C);
    slots.backend().stage_batch_u8(0, px.data(), labels.data(), norm);
    slots.backend().stage_batch(1, want.data(), labels.data());
    const std::vector<float> a = slots.images(0), b = slots.images(1);
    ASSERT_EQ(a.size(), want.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], want[i]) << "value " << i;
    EXPECT_EQ(a, b);
    EXPECT_EQ(slots.labels(0), labels);
    // Staged again, into a slot a step has read: the copy waits for that step.
    slots.backend().run(Schedule::train, 0);
    std::vector<uint8_t> px2(px.rbegin(), px.rend());
    slots.backend().stage_batch_u8(0, px2.data(), labels.data(), norm);
    std::vector<float> want2(px.size());
    normalize_u8(px2.data(), N * H * W, norm, want2.data());
    EXPECT_EQ(slots.images(0), want2);
  }
  // F16 slots: the kernel's F16 store is checked in ResampleMatchesFloat64Reference; a
  // program with F16 staged images does not validate (staged inputs are F32 under AMP too).
}

// Batches past parallel_copy's threshold (host_copy.h) reach the slots whole with one copy
// thread and with several (KILN_STAGE_COPY_THREADS), floats and bytes alike, in one piece and
// in 8 MB pieces (KILN_STAGE_IN_PIECES: the floats in three, the last one short; the bytes in one).
TEST(GpuInputKernel, StagedBatchesArriveWholeWithOneCopyThreadOrSeveral) {
  KILN_REQUIRE_GPU();
  const int64_t N = 64, H = 160, W = 160, C = 3;  // 19.7 MB of floats, 4.9 MB of bytes
  const InputNormalization norm = imagenet_norm(C);
  std::vector<uint8_t> px(static_cast<size_t>(N * H * W * C));
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + i / 4099) % 256);
  std::vector<float> from_bytes(px.size());
  normalize_u8(px.data(), N * H * W, norm, from_bytes.data());
  const std::vector<float> floats = rand_floats(N * H * W * C, 5);
  std::vector<int32_t> labels(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    labels[static_cast<size_t>(i)] = static_cast<int32_t>(i * 7 % 1000);
  for (const auto& [threads, pieces] :
       {std::pair<int64_t, bool>{1, false}, {4, false}, {1, true}, {4, true}}) {
    SCOPED_TRACE(::testing::Message() << threads << " copy threads, pieces " << pieces);
    Switches sw;
    sw.stage_copy_threads = threads;
    sw.stage_in_pieces = pieces;
    Slots slots(N, H, W, C, DType::F32, sw);
    const DecodeCounters before = slots.backend().decode_counters();
    slots.backend().stage_batch(0, floats.data(), labels.data());
    slots.backend().stage_batch_u8(1, px.data(), labels.data(), norm);
    const DecodeCounters after = slots.backend().decode_counters();
    EXPECT_EQ(after.host_batches - before.host_batches, 2) << "both copies counted";
    EXPECT_GT(after.host_copy_seconds, before.host_copy_seconds);
    EXPECT_EQ(slots.images(0), floats);
    EXPECT_EQ(slots.images(1), from_bytes);
    EXPECT_EQ(slots.labels(0), labels);
    EXPECT_EQ(slots.labels(1), labels);
  }
}

}  // namespace
}  // namespace kiln::test
