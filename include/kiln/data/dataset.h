// Datasets (SPEC S23): a Dataset hands out 8-bit HWC images with integer labels by index.
// Concrete kinds live in idx.h, cifar.h, image_folder.h and synthetic.h; open_dataset() picks
// one from a DatasetSpec, the way the CLI's --data flag names it.
//
// Contract for every Dataset: sample() is const and safe to call from many threads at once
// (the Loader's workers do), and returns the same bytes for the same index every time, so a
// run is reproducible whatever the worker count.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/core/error.h"

namespace kiln {

// An 8-bit image, rows of pixels with interleaved channels (HWC), as files store them.
struct Image {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  std::vector<uint8_t> pixels;  // height * width * channels bytes

  int64_t numel() const { return height * width * channels; }
  uint8_t at(int64_t y, int64_t x, int64_t c) const {
    return pixels[static_cast<size_t>((y * width + x) * channels + c)];
  }
};

struct Sample {
  Image image;
  int32_t label = 0;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual int64_t num_classes() const = 0;
  // Throws Error(InvalidArgument) for an index outside [0, size()).
  virtual Sample sample(int64_t index) const = 0;
  // One line for logs: kind, split and where it came from.
  virtual std::string describe() const = 0;
  // Corrupt files met and replaced so far (only image folders have any; see image_folder.h).
  virtual int64_t corrupt_skipped() const { return 0; }

  // Encoded access, for datasets of image files (image folders): the file's bytes and label,
  // read without decoding, so that the decoder can be chosen later (DCT-scaled and cropped on
  // the host, nvJPEG on the device). Corrupt files are replaced as sample() replaces them;
  // `index` of the result is the file actually read. A decoder that later finds the file
  // corrupt calls mark_corrupt(index, message) and asks for encoded(index + 1).
  virtual bool has_encoded() const { return false; }
  // encoded() returns the first file from `index` on (wrapping) that is not known corrupt,
  // can be read and has a header that parses; its size and whether nvJPEG can take it come
  // from that header.
  struct Encoded {
    int64_t index = 0;
    std::vector<uint8_t> bytes;
    int32_t label = 0;
    std::string name;
    int64_t height = 0, width = 0;
    bool device_decodable = false;  // a complete JPEG in YCbCr or grey (not CMYK, not PNG)
  };
  // Inline so that a dataset compiled alone (the fuzz targets) links without dataset.cpp.
  virtual Encoded encoded(int64_t index) const {
    (void)index;
    KILN_FAIL(Unsupported, describe(), " has no encoded samples (only image folders do)");
  }
  virtual void mark_corrupt(int64_t index, const std::string& message) const {
    (void)index, (void)message;
    KILN_FAIL(Unsupported, describe(), " has no files to mark corrupt");
  }
  virtual int64_t channels() const {
    return 0;
  }  // the channels sample() decodes to (0: fixed by the data)
};

// What the CLI's --data flag and a run file describe. Fields a kind does not use are ignored.
struct DatasetSpec {
  // "fashion-mnist", "mnist", "idx", "cifar10", "cifar100", "folder" or "synthetic".
  std::string kind;
  // Directory holding the files. fashion-mnist: empty means Debian's dataset-fashion-mnist
  // (/usr/share/datasets/fashion-mnist). mnist/idx: {train,t10k}-{images-idx3,labels-idx1}-ubyte
  // with or without .gz. cifar10/cifar100: the extracted binary tarball (the directory itself or
  // its parent holding cifar-10-batches-bin / cifar-100-binary). folder: root/<split>/<class>/*.
  std::string root;
  std::string split = "train";  // "train", or "test" / "val" (synonyms)

  // idx only: explicit files instead of the MNIST names under root.
  std::string idx_images;
  std::string idx_labels;

  // folder: channels of the decoded images (3: grayscale files are replicated; 1: colour files
  // become luma). skip_corrupt: see image_folder.h.
  int64_t channels = 3;
  bool skip_corrupt = true;
  int64_t max_image_pixels = int64_t{1} << 26;  // image_codec.h's kMaxDecodePixels

  // synthetic: `samples` images of height x width x channels random bytes, `classes` labels,
  // all drawn from `seed`.
  int64_t samples = 1024;
  int64_t height = 224;
  int64_t width = 224;
  int64_t classes = 1000;
  uint64_t seed = 0;
};

std::shared_ptr<Dataset> open_dataset(const DatasetSpec& spec);

// The kinds open_dataset() accepts, for help texts and errors.
const std::vector<std::string>& dataset_kinds();

// Per-channel mean and standard deviation of the [0,1] pixel values, for Normalize.
struct Normalization {
  std::vector<float> mean;
  std::vector<float> std;
};

// fashion-mnist (0.2860 / 0.3530) and mnist (0.1307 / 0.3081) have one channel; cifar10,
// cifar100 and folder (ImageNet's statistics, as torchvision's reference scripts use) three;
// synthetic bytes are uniform, so 0.5 / (1/sqrt(12)). `channels` > 0 asks for that many
// channels: a one-channel statistic is replicated, a mismatch otherwise is an error. An unknown
// kind, or "idx" (whose content kiln cannot know), is Error(InvalidArgument).
Normalization normalization_for(const std::string& kind, int64_t channels = 0);

}  // namespace kiln
