// AutoAugment and RandomErasing on the uint8 and GPU input paths (sample_augment.h): the loader
// draws each sample's ops and erase box from the sample's Rng in the float transforms' order,
// the same for uint8 and encoded batches; the host's augment_normalize_u8 (the CPU backend's
// staging, the CUDA kernels' reference) of a uint8 batch gives the float path's values; and the
// pipeline rules for where the augmentations may stand on those paths.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "kiln/backend/backend.h"
#include "kiln/data/auto_augment.h"
#include "kiln/data/image_codec.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/loader.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

using data_test::expect_error;

// Noisy images (every op changes them, equalize's histogram is full) of h x w x c.
class NoisyDataset : public Dataset {
 public:
  NoisyDataset(int64_t n, int64_t h, int64_t w, int64_t c) : n_(n), h_(h), w_(w), c_(c) {}
  int64_t size() const override { return n_; }
  int64_t num_classes() const override { return 3; }
  Sample sample(int64_t index) const override {
    Sample s;
    s.image = data_test::smooth_pattern(h_, w_, c_, static_cast<int>(index));
    Rng rng(static_cast<uint64_t>(index) + 100);
    for (uint8_t& v : s.image.pixels) {
      v = static_cast<uint8_t>(
          std::clamp<int64_t>(v + static_cast<int64_t>(rng.below(41)) - 20, 0, 255));
    }
    s.label = static_cast<int32_t>(index % 3);
    return s;
  }
  std::string describe() const override { return "noisy"; }

 private:
  int64_t n_, h_, w_, c_;
};

const std::vector<float> kMean = {0.485f, 0.456f, 0.406f}, kStd = {0.229f, 0.224f, 0.225f};

// The transforms of one pipeline, kept so that a test can replay the float path's draws.
struct Recipe {
  std::shared_ptr<const Transform> to_float = std::make_shared<ToFloat>();
  std::shared_ptr<const Transform> crop;
  std::shared_ptr<const Transform> flip = std::make_shared<RandomHorizontalFlip>(0.5f);
  std::shared_ptr<const AutoAugment> augment;
  std::shared_ptr<const Transform> normalize = std::make_shared<Normalize>(kMean, kStd);
  std::shared_ptr<const RandomErasing> erase;
  Pipeline pipeline() const {
    Pipeline p;
    p.add(to_float).add(crop).add(flip).add(augment).add(normalize).add(erase);
    return p;
  }
  // What the float transforms draw for this image, in their order: the crop and flip (applied,
  // so that the later draws see the cropped size), then AutoAugment's ops and the erase box.
  SampleAugment float_draws(const Image& image, Rng& rng) const {
    FloatImage f = to_float_image(image);
    to_float->apply(f, rng);
    crop->apply(f, rng);
    flip->apply(f, rng);
    SampleAugment a;
    a.ops = augment->draw(f.height, f.width, rng);
    const CropBox b = erase->sample_box(f.height, f.width, rng);
    if (b.height > 0 && b.width > 0) a.erase = EraseBox{b.top, b.left, b.height, b.width, 0.0f};
    return a;
  }
};

Recipe cifar_recipe() {
  Recipe r;
  r.crop = std::make_shared<RandomCrop>(28, 22, 4);  // not square: h and w are told apart
  r.augment = std::make_shared<AutoAugment>(AutoAugmentPolicy::rand_augment, 3, 15, 31);
  r.erase = std::make_shared<RandomErasing>(0.5f);
  return r;
}

LoaderOptions options(LoaderOutput out) {
  LoaderOptions o;
  o.batch_size = 8;
  o.workers = 2;
  o.shuffle = false;  // position k of the epoch is sample k
  o.seed = 11;
  o.output = out;
  return o;
}

// Each sample's ops and erase box on the uint8 path are what the float transforms draw for it.
TEST(DataSampleAugment, LoaderDrawsWhatTheFloatTransformsDraw) {
  const auto data = std::make_shared<NoisyDataset>(24, 32, 32, 3);
  const Recipe r = cifar_recipe();
  Loader loader(data, r.pipeline(), options(LoaderOutput::uint8));
  ASSERT_TRUE(loader.has_augments());
  const uint64_t epoch = 3;
  loader.start_epoch(static_cast<int64_t>(epoch));
  std::vector<uint8_t> px;
  std::vector<int32_t> labels(8);
  std::vector<SampleAugment> augments;
  int64_t index = 0, erased = 0;
  while (const int64_t n = loader.next_u8(px, labels.data(), &augments)) {
    ASSERT_EQ(augments.size(), 8u);
    for (int64_t k = 0; k < n; ++k, ++index) {
      Rng rng = Rng::derive(11, epoch, static_cast<uint64_t>(index) + 1);
      const SampleAugment want = r.float_draws(data->sample(index).image, rng);
      const SampleAugment& got = augments[static_cast<size_t>(k)];
      ASSERT_EQ(got.ops.size(), 3u) << "sample " << index;
      EXPECT_EQ(got.ops, want.ops) << "sample " << index;
      EXPECT_EQ(got.erase, want.erase) << "sample " << index;
      erased += got.erase.height > 0;
    }
  }
  EXPECT_EQ(index, 24);
  // p = 0.5 over 24 samples: none or all erased has odds 2^-23.
  EXPECT_GT(erased, 0);
  EXPECT_LT(erased, 24);
  // The pointer form of next_u8 cannot carry the augmentations: refused, not dropped.
  loader.start_epoch(0);
  std::vector<uint8_t> buf(static_cast<size_t>(8 * 28 * 22 * 3));
  expect_error([&] { loader.next_u8(buf.data(), labels.data()); }, ErrorKind::InvalidArgument,
               {"augmentations", "&augments"});
}

// The uint8 batch with augment_normalize_u8 against the float path's images. RandomCrop only
// copies pixels, so both paths hold the same bytes and apply the same ops to them; only the
// normalisations round differently: x * (1 / (255 std)) - mean / std against
// (x / 255 - mean) / std, a few float ulps of values below 3, so 1e-5.
TEST(DataSampleAugment, Uint8PathGivesTheFloatPathsValues) {
  const auto data = std::make_shared<NoisyDataset>(16, 32, 32, 3);
  const Recipe r = cifar_recipe();
  Loader u8(data, r.pipeline(), options(LoaderOutput::uint8));
  Loader f32(data, r.pipeline(), options(LoaderOutput::float32));
  const int64_t per = 28 * 22 * 3;
  const InputNormalization norm{kMean, kStd};
  u8.start_epoch(1);
  f32.start_epoch(1);
  std::vector<uint8_t> px;
  std::vector<SampleAugment> augments;
  std::vector<float> want(static_cast<size_t>(8 * per)), got(want.size());
  std::vector<int32_t> l1(8), l2(8);
  int64_t batches = 0, changed = 0;
  while (const int64_t n = u8.next_u8(px, l1.data(), &augments)) {
    ASSERT_EQ(f32.next(want.data(), l2.data()), n);
    EXPECT_EQ(l1, l2);
    augment_normalize_u8(px.data(), n, 28, 22, 3, augments.data(), norm, got.data());
    std::vector<float> plain(got.size());
    normalize_u8(px.data(), n * 28 * 22, norm, plain.data());
    for (int64_t i = 0; i < n * per; ++i) {
      ASSERT_NEAR(got[static_cast<size_t>(i)], want[static_cast<size_t>(i)], 1e-5)
          << "batch " << batches << " value " << i;
      changed += std::fabs(got[static_cast<size_t>(i)] - plain[static_cast<size_t>(i)]) > 1e-3;
    }
    ++batches;
  }
  EXPECT_EQ(batches, 2);
  EXPECT_GT(changed, 16 * per / 4) << "the augmentations changed too few values to test them";
}

// Image folders: the encoded batches (what the GPU decodes) carry the draws of the uint8
// batches, which are the float transforms' (RandomResizedCrop drawing on the file's full size).
TEST(DataSampleAugment, EncodedAndUint8BatchesCarryTheFloatPathsDraws) {
  data_test::TempDir dir;
  const int64_t sizes[][2] = {{40, 36}, {37, 44}, {50, 30}};
  for (int i = 0; i < 9; ++i) {
    const auto& s = sizes[i % 3];
    data_test::write_file(
        dir.path() + "/train/c" + std::to_string(i % 2) + "/img" + std::to_string(i) + ".jpg",
        encode_jpeg(data_test::smooth_pattern(s[0], s[1], 3, i), 92));
  }
  const auto data = std::make_shared<ImageFolderDataset>(dir.path() + "/train", 3, true);
  Recipe r;
  r.crop = std::make_shared<RandomResizedCrop>(24, 20, std::array<float, 2>{0.08f, 1.0f},
                                               std::array<float, 2>{3.0f / 4.0f, 4.0f / 3.0f});
  r.augment = std::make_shared<AutoAugment>(AutoAugmentPolicy::trivial_augment_wide);
  r.erase = std::make_shared<RandomErasing>(0.7f);
  LoaderOptions eo = options(LoaderOutput::encoded);
  eo.batch_size = 3;
  LoaderOptions uo = options(LoaderOutput::uint8);
  uo.batch_size = 3;
  Loader enc(data, r.pipeline(), eo), u8(data, r.pipeline(), uo);
  enc.start_epoch(2);
  u8.start_epoch(2);
  EncodedBatch b;
  std::vector<uint8_t> px;
  std::vector<int32_t> labels(3);
  std::vector<SampleAugment> augments;
  int64_t index = 0;
  while (const int64_t n = enc.next_encoded(b)) {
    ASSERT_EQ(u8.next_u8(px, labels.data(), &augments), n);
    for (int64_t k = 0; k < n; ++k, ++index) {
      const SampleAugment& e = b.images[static_cast<size_t>(k)].augment;
      EXPECT_EQ(e, augments[static_cast<size_t>(k)]) << "sample " << index;
      Rng rng = Rng::derive(11, 2, static_cast<uint64_t>(index) + 1);
      const SampleAugment want = r.float_draws(data->sample(index).image, rng);
      EXPECT_EQ(e, want) << "sample " << index;
      EXPECT_EQ(e.ops.size(), 1u);
    }
  }
  EXPECT_EQ(index, 9);
}

// Where the augmentations may stand on the uint8 / GPU path: AutoAugment after the crop, resize
// and flip and before Normalize; one RandomErasing, last. geometric() (no augmentations) still
// refuses both, and the geometry without the augmentations' receiver is refused too.
TEST(DataSampleAugment, PipelineRules) {
  const Recipe r = cifar_recipe();
  const Pipeline good = r.pipeline();
  std::string why;
  EXPECT_TRUE(good.geometric_with_augments(&why)) << why;
  EXPECT_TRUE(good.has_augments());
  EXPECT_FALSE(good.geometric());
  Rng rng(1);
  EXPECT_THROW(good.geometry(32, 32, rng), Error);
  SampleAugment a;
  EXPECT_EQ(good.geometry(32, 32, rng, a).out_h(), 28);

  auto refused = [&](Pipeline p, std::vector<std::string> parts) {
    std::string w;
    EXPECT_FALSE(p.geometric_with_augments(&w)) << p.describe();
    for (const std::string& s : parts) EXPECT_NE(w.find(s), std::string::npos) << w;
  };
  Pipeline late_aa;
  late_aa.add(r.to_float).add(r.crop).add(r.normalize).add(r.augment);
  refused(late_aa, {"RandAugment", "before it normalises"});
  Pipeline crop_after;
  crop_after.add(r.to_float).add(r.augment).add(r.crop);
  refused(crop_after, {"RandomCrop", "crop, resize and flip before it"});
  Pipeline erase_first;
  erase_first.add(r.to_float).add(r.crop).add(r.erase).add(r.normalize);
  refused(erase_first, {"Normalize", "last"});
  Pipeline two_erases;
  two_erases.add(r.to_float).add(r.normalize).add(r.erase).add(r.erase);
  refused(two_erases, {"RandomErasing", "last"});
  Pipeline jitter;
  jitter.add(r.to_float).add(r.crop).add<ColorJitter>(0.4f, 0.4f, 0.4f).add(r.normalize);
  refused(jitter, {"ColorJitter", "changes pixel values"});
  Pipeline plain;
  plain.add(r.to_float).add(r.crop).add(r.normalize);
  EXPECT_TRUE(plain.geometric_with_augments());
  EXPECT_FALSE(plain.has_augments());
}

// augment_normalize_u8 checks what it is given: an erase box outside the image is one error.
TEST(DataSampleAugment, HostAugmentRefusesABoxOutsideTheImage) {
  std::vector<uint8_t> px(4 * 4 * 3, 100);
  std::vector<float> out(px.size());
  SampleAugment a;
  a.erase = EraseBox{2, 1, 3, 2, 0.0f};  // rows 2..4 of 4
  const InputNormalization norm{kMean, kStd};
  expect_error([&] { augment_normalize_u8(px.data(), 1, 4, 4, 3, &a, norm, out.data()); },
               ErrorKind::InvalidArgument, {"erase box", "not inside"});
  a.erase = EraseBox{1, 1, 2, 2, -1.5f};
  augment_normalize_u8(px.data(), 1, 4, 4, 3, &a, norm, out.data());
  for (int64_t y = 0; y < 4; ++y) {
    for (int64_t x = 0; x < 4; ++x) {
      const bool in = y >= 1 && y < 3 && x >= 1 && x < 3;
      for (int64_t c = 0; c < 3; ++c) {
        const float want = in ? -1.5f
                              : 100.0f * (1.0f / (255.0f * kStd[static_cast<size_t>(c)])) -
                                    kMean[static_cast<size_t>(c)] / kStd[static_cast<size_t>(c)];
        EXPECT_EQ(out[static_cast<size_t>((y * 4 + x) * 3 + c)], want) << y << "," << x;
      }
    }
  }
}

}  // namespace
}  // namespace kiln
