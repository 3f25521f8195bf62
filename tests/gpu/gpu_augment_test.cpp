// RandAugment / TrivialAugmentWide and RandomErasing on the GPU input paths (augment_stage.h)
// against the host's augment_normalize_u8 (apply_augment_params, normalize_u8, the erase box):
// every op on fixed and random images of several sizes and both channel counts at the ends of
// its magnitude ranges, drawn op sequences with erase boxes, the byte resample the ops start
// from, erasing alone on the unrounded resample, stage_batch_u8 with augmentations, and an
// encoded batch with --auto-augment ra and --random-erase through stage_batch_encoded against
// the uint8 host path for the same seeds. The kernels repeat the host's float32 steps with the
// same roundings, so the comparisons are exact unless a test says otherwise.
#include <gtest/gtest.h>

#if defined(KILN_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/augment_stage.h"
#include "backend/cuda/input_stage.h"
#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/data/auto_augment.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/loader.h"
#include "kiln/task/engine.h"
#include "kiln/task/trainer.h"
#include "unit/data_test_util.h"

namespace kiln::test {
namespace {

#define CUDA_OK(call)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_); \
  } while (0)

// Device memory freed at scope end.
struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) {
    if (cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

InputNormalization test_norm(int64_t c) {
  if (c == 1) return {{0.449f}, {0.226f}};
  return {{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}};
}

enum class Content { random, constant, gradient, checker, narrow };
const char* content_name(Content k) {
  static const char* const names[] = {"random", "constant", "gradient", "checker", "narrow"};
  return names[static_cast<int>(k)];
}

// Fixed images that reach the ops' corner cases (a constant image: autocontrast's infinite
// scale and equalize's zero step; narrow: a range of four levels) and random ones.
std::vector<uint8_t> make_image(int64_t h, int64_t w, int64_t c, Content k, uint64_t seed) {
  std::vector<uint8_t> px(static_cast<size_t>(h * w * c));
  Rng rng(seed);
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int64_t ch = 0; ch < c; ++ch) {
        uint8_t v = 0;
        switch (k) {
          case Content::random:
            v = static_cast<uint8_t>(rng.below(256));
            break;
          case Content::constant:
            v = 77;
            break;
          case Content::gradient:
            v = static_cast<uint8_t>((x * 255 / std::max<int64_t>(w - 1, 1) + 40 * ch) % 256);
            break;
          case Content::checker:
            v = ((x / 2 + y / 3) % 2) ? 250 : 3;
            break;
          case Content::narrow:
            v = static_cast<uint8_t>(100 + rng.below(4));
            break;
        }
        px[static_cast<size_t>((y * w + x) * c + ch)] = v;
      }
    }
  }
  return px;
}

// Every op at the ends of both policies' magnitude tables (bins 0, 1, the middle and the last),
// both signs where it has one, and a few values off the tables (non-integral translations,
// solarize thresholds between levels, posterize keeping 0 and 8 bits).
std::vector<std::pair<AugmentOp, double>> op_cases(int64_t h, int64_t w) {
  std::vector<std::pair<AugmentOp, double>> out;
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 2, 9, 31);
  const AutoAugment ta(AutoAugmentPolicy::trivial_augment_wide);
  for (int o = 0; o < kAugmentOps; ++o) {
    const auto op = static_cast<AugmentOp>(o);
    for (const AutoAugment* a : {&ra, &ta}) {
      for (int bin : {0, 1, 15, 30}) {
        const double m = a->magnitude(op, bin, h, w);
        out.emplace_back(op, m);
        if (AutoAugment::signed_op(op) && m != 0) out.emplace_back(op, -m);
      }
    }
  }
  out.emplace_back(AugmentOp::translate_x, 1.7);
  out.emplace_back(AugmentOp::translate_y, -2.5);
  out.emplace_back(AugmentOp::rotate, 90.0);
  out.emplace_back(AugmentOp::rotate, -45.0);
  for (double t : {0.5, 127.5, 128.0, 255.5, 256.0}) out.emplace_back(AugmentOp::solarize, t);
  for (double b : {0.0, 1.0, 7.0, 8.0}) out.emplace_back(AugmentOp::posterize, b);
  return out;
}

// The batch's device descriptors, uploaded with plain copies (the kernel alone under test).
struct DeviceAugments {
  std::unique_ptr<DevBuf> descs, ops;
};
void upload_descs(const std::vector<SampleAugment>& augments, int64_t h, int64_t w, int64_t c,
                  DeviceAugments* out) {
  std::vector<const SampleAugment*> ptrs;
  for (const SampleAugment& a : augments) ptrs.push_back(&a);
  std::vector<cuda::AugmentDesc> descs;
  std::vector<AugmentOpParams> ops;
  const auto n = static_cast<int64_t>(ptrs.size());
  cuda::build_augment_descs(ptrs.data(), n, n, h, w, c, &descs, &ops);
  out->descs = std::make_unique<DevBuf>(descs.size() * sizeof(cuda::AugmentDesc));
  out->ops = std::make_unique<DevBuf>(ops.size() * sizeof(AugmentOpParams));
  CUDA_OK(cudaMemcpy(out->descs->p, descs.data(), descs.size() * sizeof(cuda::AugmentDesc),
                     cudaMemcpyHostToDevice));
  if (!ops.empty()) {
    CUDA_OK(cudaMemcpy(out->ops->p, ops.data(), ops.size() * sizeof(AugmentOpParams),
                       cudaMemcpyHostToDevice));
  }
}

// launch_augment_normalize over `batch` samples of h x w x c (bytes in px) into F32 or F16.
std::vector<float> run_kernel(const std::vector<uint8_t>& px,
                              const std::vector<SampleAugment>& augments, int64_t h, int64_t w,
                              int64_t c, DType dtype) {
  const int64_t batch = static_cast<int64_t>(augments.size());
  DeviceAugments d;
  upload_descs(augments, h, w, c, &d);
  DevBuf pixels(px.size()), scratch(px.size());
  const size_t elem = dtype == DType::F32 ? 4 : 2;
  DevBuf out(px.size() * elem);
  EXPECT_EQ(cudaMemcpy(pixels.p, px.data(), px.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const cuda::NormParams np = cuda::make_norm_params(test_norm(c), c, "test");
  cuda::launch_augment_normalize(pixels.as<uint8_t>(), scratch.as<uint8_t>(),
                                 d.descs->as<cuda::AugmentDesc>(), d.ops->as<AugmentOpParams>(),
                                 batch, h, w, np, out.p, dtype, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(px.size());
  if (dtype == DType::F32) {
    EXPECT_EQ(cudaMemcpy(got.data(), out.p, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::vector<uint16_t> half(px.size());
    EXPECT_EQ(cudaMemcpy(half.data(), out.p, half.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < half.size(); ++i) got[i] = half_to_float(half[i]);
  }
  return got;
}

std::vector<float> host_reference(const std::vector<uint8_t>& px,
                                  const std::vector<SampleAugment>& augments, int64_t h, int64_t w,
                                  int64_t c) {
  std::vector<float> want(px.size());
  augment_normalize_u8(px.data(), static_cast<int64_t>(augments.size()), h, w, c, augments.data(),
                       test_norm(c), want.data());
  return want;
}

// One op a sample, each image with every op case in one batch: the bytes the host's
// apply_augment_params computes, normalised alike, bit for bit.
TEST(GpuAugment, EachOpMatchesTheHost) {
  KILN_REQUIRE_GPU();
  const std::pair<int64_t, int64_t> sizes[] = {{1, 1},   {2, 3},   {3, 3},  {7, 5},
                                               {16, 16}, {33, 47}, {64, 96}};
  const Content contents[] = {Content::random, Content::constant, Content::gradient,
                              Content::checker, Content::narrow};
  for (int64_t c : {int64_t{3}, int64_t{1}}) {
    for (const auto& [h, w] : sizes) {
      const auto cases = op_cases(h, w);
      for (Content content : contents) {
        const std::vector<uint8_t> image =
            make_image(h, w, c, content, static_cast<uint64_t>(h * w));
        std::vector<uint8_t> px;
        std::vector<SampleAugment> augments;
        for (const auto& op : cases) {
          px.insert(px.end(), image.begin(), image.end());
          SampleAugment a;
          a.ops.push_back(op);
          augments.push_back(a);
        }
        const std::vector<float> want = host_reference(px, augments, h, w, c);
        const std::vector<float> got = run_kernel(px, augments, h, w, c, DType::F32);
        const int64_t per = h * w * c;
        for (size_t k = 0; k < cases.size(); ++k) {
          for (int64_t i = 0; i < per; ++i) {
            const size_t at = k * static_cast<size_t>(per) + static_cast<size_t>(i);
            ASSERT_EQ(got[at], want[at])
                << augment_op_name(cases[k].first) << " " << cases[k].second << " on a " << h << "x"
                << w << "x" << c << " " << content_name(content) << " image, value " << i;
          }
        }
      }
    }
  }
}

// Drawn op sequences (RandAugment with 4 ops at the top magnitude, TrivialAugmentWide) with
// RandomErasing's boxes, some samples plain, in F32 and F16 (the host's floats rounded to half),
// through AugmentStage twice (the second batch reuses its buffers).
TEST(GpuAugment, DrawnSequencesAndErasingMatchTheHost) {
  KILN_REQUIRE_GPU();
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 4, 30, 31);
  const AutoAugment ta(AutoAugmentPolicy::trivial_augment_wide);
  const RandomErasing erase(0.6f);
  cuda::AugmentStage stage;
  for (const auto& [h, w, c] :
       {std::array<int64_t, 3>{40, 56, 3}, std::array<int64_t, 3>{28, 28, 1}}) {
    for (int round = 0; round < 2; ++round) {
      const int64_t batch = 24;
      std::vector<uint8_t> px;
      std::vector<SampleAugment> augments(static_cast<size_t>(batch));
      for (int64_t k = 0; k < batch; ++k) {
        const auto img = make_image(h, w, c, k % 3 == 0 ? Content::gradient : Content::random,
                                    static_cast<uint64_t>(100 * round + k));
        px.insert(px.end(), img.begin(), img.end());
        Rng rng = Rng::derive(5, static_cast<uint64_t>(round), static_cast<uint64_t>(k));
        SampleAugment& a = augments[static_cast<size_t>(k)];
        if (k % 5 != 4) a.ops = (k % 2 ? ta : ra).draw(h, w, rng);
        const CropBox b = erase.sample_box(h, w, rng);
        if (b.height > 0 && b.width > 0) a.erase = EraseBox{b.top, b.left, b.height, b.width, 0};
      }
      const std::vector<float> want = host_reference(px, augments, h, w, c);
      for (DType dtype : {DType::F32, DType::F16}) {
        const std::vector<float> got = run_kernel(px, augments, h, w, c, dtype);
        for (size_t i = 0; i < want.size(); ++i) {
          const float wi = dtype == DType::F32 ? want[i] : half_to_float(float_to_half(want[i]));
          ASSERT_EQ(got[i], wi) << dtype_name(dtype) << " " << h << "x" << w << "x" << c
                                << " value " << i << " (sample " << i / (h * w * c) << ")";
        }
      }
      // The same through AugmentStage (its own upload and scratch).
      DevBuf pixels(px.size()), out(px.size() * 4);
      CUDA_OK(cudaMemcpy(pixels.p, px.data(), px.size(), cudaMemcpyHostToDevice));
      stage.stage_u8(pixels.as<uint8_t>(), augments.data(), batch, h, w,
                     cuda::make_norm_params(test_norm(c), c, "test"), out.p, DType::F32, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> got(px.size());
      CUDA_OK(cudaMemcpy(got.data(), out.p, got.size() * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got, want) << h << "x" << w << "x" << c << " round " << round;
    }
  }
}

// Geometries of the sample_geometry.h contract for the byte kernel.
ResampleAxis axis(int64_t out, double origin, double scale, int64_t lo, int64_t hi,
                  ResampleFilter f = ResampleFilter::bilinear) {
  ResampleAxis a;
  a.out = out, a.origin = origin, a.scale = scale, a.lo = lo, a.hi = hi;
  a.valid_lo = 0, a.valid_hi = out, a.filter = f;
  return a;
}

// launch_stage_samples_u8 against the host's resample_u8: the same taps and rounding (v + 0.5,
// clamped, truncated), the float sums in another order (about 1e-5 of a level), so a value
// within that of a half level may round the other way: at most 1 level apart, and such values
// are rare (under 1%). A plain copy (host-decoded samples) is exact.
TEST(GpuAugment, ResampledBytesRoundLikeTheHost) {
  KILN_REQUIRE_GPU();
  const int64_t H = 24, W = 20, C = 3;
  struct Case {
    int64_t h, w;
    ResampleAxis y, x;
    bool flip;
  };
  const Case cases[] = {
      {97, 131, axis(H, 10, 70.0 / H, 10, 80), axis(W, 20, 90.0 / W, 20, 110), false},
      {30, 25, axis(H, 3, 12.0 / H, 3, 15), axis(W, 2, 9.0 / W, 2, 11), true},
      {97, 131, axis(H, 10, 70.0 / H, 10, 80, ResampleFilter::bicubic),
       axis(W, 20, 90.0 / W, 20, 110, ResampleFilter::bicubic), true},
      {24, 20, axis(H, 0, 1, 0, 24), axis(W, 0, 1, 0, 20), false},
  };
  const int64_t n = 4, per = H * W * C;
  std::vector<cuda::SampleDesc> descs;
  std::vector<std::unique_ptr<DevBuf>> srcs;
  std::vector<uint8_t> want(static_cast<size_t>(n * per));
  for (int64_t i = 0; i < n; ++i) {
    const Case& s = cases[i];
    const std::vector<uint8_t> px = make_image(s.h, s.w, C, Content::random, 7 + i);
    SampleGeometry g = SampleGeometry::identity(s.h, s.w);
    g.y = s.y, g.x = s.x, g.flip = s.flip;
    resample_u8(px.data(), s.h, s.w, C, s.w * C, g, want.data() + i * per);
    srcs.push_back(std::make_unique<DevBuf>(px.size()));
    CUDA_OK(cudaMemcpy(srcs.back()->p, px.data(), px.size(), cudaMemcpyHostToDevice));
    cuda::SampleDesc d;
    d.src = srcs.back()->as<uint8_t>();
    d.pitch = s.w * C;
    d.y = cuda::axis_desc(g.y, s.h);
    d.x = cuda::axis_desc(g.x, s.w);
    d.flip = s.flip;
    descs.push_back(d);
  }
  DevBuf d_descs(descs.size() * sizeof(cuda::SampleDesc)), out(want.size());
  CUDA_OK(cudaMemcpy(d_descs.p, descs.data(), descs.size() * sizeof(cuda::SampleDesc),
                     cudaMemcpyHostToDevice));
  cuda::launch_stage_samples_u8(d_descs.as<cuda::SampleDesc>(), n, H, W, C, out.as<uint8_t>(),
                                nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(want.size());
  CUDA_OK(cudaMemcpy(got.data(), out.p, got.size(), cudaMemcpyDeviceToHost));
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < per; ++j) {
      const size_t at = static_cast<size_t>(i * per + j);
      const int d = std::abs(static_cast<int>(got[at]) - static_cast<int>(want[at]));
      ASSERT_LE(d, 1) << "sample " << i << " value " << j;
      if (i == n - 1) ASSERT_EQ(d, 0) << "the copy, value " << j;
      off += d != 0;
    }
  }
  EXPECT_LT(off, n * per / 100);
}

// Erasing alone leaves the resample kernel's unrounded values as they are outside the box and
// writes the value inside it, in every channel.
TEST(GpuAugment, ErasingAloneKeepsTheUnroundedResample) {
  KILN_REQUIRE_GPU();
  const int64_t H = 16, W = 12, C = 3, sh = 50, sw = 41;
  const std::vector<uint8_t> px = make_image(sh, sw, C, Content::random, 3);
  DevBuf src(px.size());
  CUDA_OK(cudaMemcpy(src.p, px.data(), px.size(), cudaMemcpyHostToDevice));
  std::vector<cuda::SampleDesc> descs(2);
  for (int k = 0; k < 2; ++k) {
    descs[static_cast<size_t>(k)].src = src.as<uint8_t>();
    descs[static_cast<size_t>(k)].pitch = sw * C;
    descs[static_cast<size_t>(k)].y = cuda::axis_desc(axis(H, 5, 40.0 / H, 5, 45), sh);
    descs[static_cast<size_t>(k)].x = cuda::axis_desc(axis(W, 3, 30.0 / W, 3, 33), sw);
    descs[static_cast<size_t>(k)].flip = k;
  }
  std::vector<cuda::AugmentDesc> aug(2);
  aug[0].erase_top = 3, aug[0].erase_left = 2, aug[0].erase_h = 7, aug[0].erase_w = 9;
  aug[0].erase_value = -0.75f;  // sample 1: nothing erased
  DevBuf d_descs(descs.size() * sizeof(cuda::SampleDesc)), d_aug(aug.size() * sizeof(aug[0]));
  CUDA_OK(
      cudaMemcpy(d_descs.p, descs.data(), descs.size() * sizeof(descs[0]), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_aug.p, aug.data(), aug.size() * sizeof(aug[0]), cudaMemcpyHostToDevice));
  const cuda::NormParams np = cuda::make_norm_params(test_norm(C), C, "test");
  const int64_t per = H * W * C;
  DevBuf plain(2 * per * 4), erased(2 * per * 4);
  cuda::launch_stage_samples(d_descs.as<cuda::SampleDesc>(), 2, H, W, np, plain.p, DType::F32,
                             nullptr);
  cuda::launch_stage_samples(d_descs.as<cuda::SampleDesc>(), 2, H, W, np, erased.p, DType::F32,
                             nullptr, d_aug.as<cuda::AugmentDesc>());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> a(static_cast<size_t>(2 * per)), b(a.size());
  CUDA_OK(cudaMemcpy(a.data(), plain.p, a.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(b.data(), erased.p, b.size() * 4, cudaMemcpyDeviceToHost));
  for (int64_t k = 0; k < 2; ++k) {
    for (int64_t y = 0; y < H; ++y) {
      for (int64_t x = 0; x < W; ++x) {
        const bool in = k == 0 && y >= 3 && y < 10 && x >= 2 && x < 11;
        for (int64_t c = 0; c < C; ++c) {
          const size_t at = static_cast<size_t>(k * per + (y * W + x) * C + c);
          ASSERT_EQ(b[at], in ? -0.75f : a[at]) << k << ": " << y << "," << x << "," << c;
        }
      }
    }
  }
}

std::unique_ptr<Engine> cuda_engine(int64_t batch, int image_size, Switches switches) {
  EngineOptions o;
  o.device = "cuda";
  o.switches = std::move(switches);
  o.compile.batch = batch;
  ZooOptions zo;  // the small CNN, on RGB: the input slots are what these tests need
  zo.image_size = image_size;
  zo.in_channels = 3;
  auto e = std::make_unique<Engine>(make_model("cnn", zo), o);
  e->lock_memory();
  e->compile(1);
  return e;
}

// stage_batch_u8 with augmentations: the device's bytes, ops, normalisation and erasing are
// augment_normalize_u8's; staged twice into each slot (its buffers reused), and without
// augmentations it is the plain normalisation still.
TEST(GpuAugment, StageBatchU8AppliesTheAugmentations) {
  KILN_REQUIRE_GPU();
  const int64_t N = 6, S = 32, C = 3;
  auto engine = cuda_engine(N, static_cast<int>(S), Switches::from_environment());
  Backend& b = engine->backend();
  const Program& p = engine->program();
  const AutoAugment ra(AutoAugmentPolicy::rand_augment, 2, 9, 31);
  const RandomErasing erase(0.5f);
  const InputNormalization norm = test_norm(C);
  std::vector<int32_t> labels(N, 1);
  for (int round = 0; round < 2; ++round) {
    for (int slot = 0; slot < 2; ++slot) {
      std::vector<uint8_t> px;
      std::vector<SampleAugment> augments(N);
      for (int64_t k = 0; k < N; ++k) {
        const auto img =
            make_image(S, S, C, Content::random, static_cast<uint64_t>(10 * round + k));
        px.insert(px.end(), img.begin(), img.end());
        Rng rng = Rng::derive(9, static_cast<uint64_t>(round * 2 + slot), static_cast<uint64_t>(k));
        augments[static_cast<size_t>(k)].ops = ra.draw(S, S, rng);
        const CropBox e = erase.sample_box(S, S, rng);
        if (e.height > 0 && e.width > 0) {
          augments[static_cast<size_t>(k)].erase = EraseBox{e.top, e.left, e.height, e.width, 0};
        }
      }
      std::vector<float> want(px.size());
      augment_normalize_u8(px.data(), N, S, S, C, augments.data(), norm, want.data());
      b.stage_batch_u8(slot, px.data(), labels.data(), norm, augments.data());
      const DTensor& t = p.tensor(p.io.staged_images[static_cast<size_t>(slot)]);
      EXPECT_EQ(read_floats(b, t), want) << "round " << round << " slot " << slot;
      b.stage_batch_u8(slot, px.data(), labels.data(), norm, nullptr);
      std::vector<float> plain(px.size());
      normalize_u8(px.data(), N * S * S, norm, plain.data());
      EXPECT_EQ(read_floats(b, t), plain);
    }
  }
}

// The training recipe's input through the encoded path: a JPEG folder, RandomResizedCrop, flip,
// RandAugment, Normalize and RandomErasing, the same seed as the uint8 host path. With nvJPEG
// off every image goes through host_decode, so the device starts from the host's bytes and
// must give augment_normalize_u8 of the uint8 batch exactly; the two loaders' draws are the
// same. With nvJPEG on the decoders round differently (gpu_jpeg_test's tolerances), which the
// ops can amplify, so the reference starts from the device's own resampled bytes instead.
TEST(GpuAugment, EncodedBatchWithRandAugmentIsTheHostPath) {
  KILN_REQUIRE_GPU();
  data_test::TempDir dir;
  const int64_t sizes[][2] = {{60, 48}, {47, 64}, {80, 40}, {33, 33}};
  for (int i = 0; i < 16; ++i) {
    const auto& s = sizes[i % 4];
    data_test::write_file(
        dir.path() + "/train/c" + std::to_string(i % 2) + "/img" + std::to_string(i) + ".jpg",
        encode_jpeg(data_test::smooth_pattern(s[0], s[1], 3, i), 92));
  }
  const auto data = std::make_shared<ImageFolderDataset>(dir.path() + "/train", 3, true);
  const int64_t N = 8, S = 32, C = 3;
  const InputNormalization norm = test_norm(C);
  Pipeline pipeline;
  pipeline.add<ToFloat>()
      .add<RandomResizedCrop>(S)
      .add<RandomHorizontalFlip>(0.5f)
      .add<AutoAugment>(AutoAugmentPolicy::rand_augment, 2, 9, 31)
      .add<Normalize>(norm.mean, norm.std)
      .add<RandomErasing>(0.5f);
  LoaderOptions lo;
  lo.batch_size = N;
  lo.workers = 2;
  lo.seed = 21;
  lo.output = LoaderOutput::encoded;
  LoaderOptions uo = lo;
  uo.output = LoaderOutput::uint8;
  for (const char* nvjpeg : {"0", "1"}) {
    Switches sw = Switches::from_environment();
    sw.set("nvjpeg", nvjpeg, "KILN_NVJPEG");
    auto engine = cuda_engine(N, static_cast<int>(S), sw);
    Backend& b = engine->backend();
    if (std::string(nvjpeg) == "1" && !b.decodes_jpeg()) continue;  // a build without nvJPEG
    Loader enc(data, pipeline, lo), u8(data, pipeline, uo);
    enc.start_epoch(1);
    u8.start_epoch(1);
    EncodedBatch batch;
    std::vector<uint8_t> px;
    std::vector<int32_t> labels(N);
    std::vector<SampleAugment> augments;
    const DTensor& t = engine->program().tensor(engine->program().io.staged_images[0]);
    int64_t erased = 0;
    for (int64_t i = 0; i < 2; ++i) {
      ASSERT_EQ(enc.next_encoded(batch), N);
      ASSERT_EQ(u8.next_u8(px, labels.data(), &augments), N);
      for (int64_t k = 0; k < N; ++k) {
        EXPECT_EQ(batch.images[static_cast<size_t>(k)].augment, augments[static_cast<size_t>(k)])
            << "sample " << k;
      }
      b.stage_batch_encoded(0, batch, norm);
      const std::vector<float> got = read_floats(b, t);
      std::vector<float> want(px.size());
      augment_normalize_u8(px.data(), N, S, S, C, augments.data(), norm, want.data());
      if (std::string(nvjpeg) == "0") {
        EXPECT_EQ(got, want) << "batch " << i;
        continue;
      }
      // nvJPEG's bytes: the same batch with an identity op in place of each augmentation
      // (which keeps the byte path) and mean 0, std 1/255 (x = v * scale with scale within an
      // ulp of 1, so rounding gives v back) into slot 1; the host's ops on them must give slot
      // 0's values.
      EncodedBatch plain = batch;
      for (EncodedImage& im : plain.images) im.augment = {{{AugmentOp::identity, 0.0}}, {}};
      const InputNormalization unit{std::vector<float>(C, 0.0f),
                                    std::vector<float>(C, 1.0f / 255.0f)};
      b.stage_batch_encoded(1, plain, unit);
      const std::vector<float> levels =
          read_floats(b, engine->program().tensor(engine->program().io.staged_images[1]));
      std::vector<uint8_t> bytes(levels.size());
      for (size_t j = 0; j < levels.size(); ++j) {
        ASSERT_NEAR(levels[j], std::nearbyint(levels[j]), 1e-3) << "value " << j;
        bytes[j] = static_cast<uint8_t>(std::nearbyint(levels[j]));
      }
      augment_normalize_u8(bytes.data(), N, S, S, C, augments.data(), norm, want.data());
      EXPECT_EQ(got, want) << "batch " << i << " (nvJPEG)";
      for (const SampleAugment& a : augments) erased += a.erase.height > 0;
    }
    if (std::string(nvjpeg) == "1") EXPECT_GT(erased, 0) << "p = 0.5 over 16 samples";
  }
}

// A partial encoded batch whose samples come as host pixels (no file bytes): the augmented
// samples are augment_normalize_u8's, the padding sample is 0 as on the unaugmented path.
TEST(GpuAugment, PartialEncodedBatchPadsWithZeros) {
  KILN_REQUIRE_GPU();
  const int64_t N = 3, S = 32, C = 3, per = S * S * C;
  auto engine = cuda_engine(N, static_cast<int>(S), Switches::from_environment());
  EncodedBatch b;
  b.size = 2, b.batch = N, b.height = S, b.width = S, b.channels = C;
  b.images.resize(2);
  b.labels = {4, 5, -1};
  std::vector<SampleAugment> augments(2);
  augments[0].ops = {{AugmentOp::equalize, 0.0}, {AugmentOp::shear_x, -0.3}};
  augments[1].ops = {{AugmentOp::sharpness, 0.9}};
  augments[1].erase = EraseBox{4, 5, 10, 6, 0.0f};
  for (int64_t k = 0; k < 2; ++k) {
    const auto img = make_image(S, S, C, Content::random, static_cast<uint64_t>(k));
    b.host_pixels.insert(b.host_pixels.end(), img.begin(), img.end());
    b.images[static_cast<size_t>(k)].geometry = SampleGeometry::identity(S, S);
    b.images[static_cast<size_t>(k)].augment = augments[static_cast<size_t>(k)];
    b.images[static_cast<size_t>(k)].name = "host" + std::to_string(k);
  }
  b.host_pixels.resize(static_cast<size_t>(N * per), 0);
  const InputNormalization norm = test_norm(C);
  std::vector<float> want(static_cast<size_t>(N * per), 0.0f);
  augment_normalize_u8(b.host_pixels.data(), 2, S, S, C, augments.data(), norm, want.data());
  engine->backend().stage_batch_encoded(1, b, norm);
  const Program& p = engine->program();
  EXPECT_EQ(read_floats(engine->backend(), p.tensor(p.io.staged_images[1])), want);
}

// The trainer on the GPU with --auto-augment ra and --random-erase: --decode gpu keeps the
// encoded input (it used to refuse these flags) and --decode cpu the uint8 one, and both train.
TEST(GpuAugment, TrainerKeepsTheDevicePathsWithTheAugmentations) {
  KILN_REQUIRE_GPU();
  if (!make_backend("cuda")->decodes_jpeg()) GTEST_SKIP() << "this build or GPU has no nvJPEG";
  data_test::TempDir dir;
  const int64_t sizes[][2] = {{60, 48}, {47, 64}, {80, 40}};
  for (const char* split : {"train", "test"}) {
    for (int i = 0; i < 8; ++i) {
      const auto& s = sizes[i % 3];
      data_test::write_file(dir.path() + "/" + split + "/c" + std::to_string(i % 2) + "/img" +
                                std::to_string(i) + ".jpg",
                            encode_jpeg(data_test::smooth_pattern(s[0], s[1], 3, i), 92));
    }
  }
  for (const DecodeWhere where : {DecodeWhere::gpu, DecodeWhere::cpu}) {
    TrainConfig c;
    c.model = "resnet18_small";
    c.image_size = 32;
    c.data = "folder";
    c.data_dir = dir.path();
    c.random_resized_crop = true;
    c.auto_augment = "ra";
    c.random_erase = 0.25f;
    c.decode = where;
    c.batch_size = 4;
    c.epochs = 1;
    c.workers = 2;
    c.device = "cuda";
    c.progress = "none";
    c.output = dir.path() + "/run_" + decode_where_name(where);
    const TrainSummary r = train(c);
    EXPECT_EQ(r.input, where == DecodeWhere::gpu ? "encoded" : "uint8");
    EXPECT_EQ(r.steps, 2);  // 8 training images in batches of 4
    EXPECT_TRUE(std::isfinite(r.final_loss));
  }
}

}  // namespace
}  // namespace kiln::test
#endif  // KILN_HAVE_CUDA
