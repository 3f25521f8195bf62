// open_dataset(): the one place that maps a kind name to a Dataset, and the per-dataset
// normalisation statistics.
#include "kiln/data/dataset.h"

#include <cmath>

#include "kiln/core/error.h"
#include "kiln/data/cifar.h"
#include "kiln/data/idx.h"
#include "kiln/data/image_folder.h"
#include "kiln/data/input_batch.h"
#include "kiln/data/synthetic.h"

namespace kiln {
namespace {

// Installed by Debian's dataset-fashion-mnist package (scripts/setup.sh installs it).
constexpr const char* kDebianFashionMnist = "/usr/share/datasets/fashion-mnist";

std::string kinds_list() {
  std::string s;
  for (const auto& k : dataset_kinds()) s += (s.empty() ? "" : ", ") + k;
  return s;
}

}  // namespace

const std::vector<std::string>& dataset_kinds() {
  static const std::vector<std::string> kinds = {"fashion-mnist", "mnist",  "idx",      "cifar10",
                                                 "cifar100",      "folder", "synthetic"};
  return kinds;
}

std::shared_ptr<Dataset> open_dataset(const DatasetSpec& spec) {
  const std::string& kind = spec.kind;
  if (kind == "synthetic") {
    return std::make_shared<SyntheticDataset>(spec.samples, spec.height, spec.width, spec.channels,
                                              spec.classes, spec.seed);
  }
  KILN_CHECK(spec.split == "train" || spec.split == "test" || spec.split == "val", InvalidArgument,
             "unknown data split '", spec.split, "'; use train, test or val");
  if (kind == "fashion-mnist" || kind == "mnist" || kind == "idx") {
    if (kind == "idx" && (!spec.idx_images.empty() || !spec.idx_labels.empty())) {
      KILN_CHECK(!spec.idx_images.empty() && !spec.idx_labels.empty(), InvalidArgument,
                 "an idx dataset given by files needs both the images and the labels file");
      return IdxDataset::open(spec.idx_images, spec.idx_labels, kind + " " + spec.split);
    }
    std::string root = spec.root;
    if (root.empty() && kind == "fashion-mnist") root = kDebianFashionMnist;
    KILN_CHECK(!root.empty(), InvalidArgument, "the ", kind,
               " dataset needs a directory (--data "
               "DIR) holding {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]");
    // Images first, so that a missing images file is the one reported.
    const std::string images = mnist_file(root, spec.split, true);
    const std::string labels = mnist_file(root, spec.split, false);
    // MNIST and Fashion-MNIST have ten classes whatever the labels say; a generic idx file
    // takes its count from its labels (the trainer checks the other split against it).
    return IdxDataset::open(images, labels, kind + " " + spec.split, kind == "idx" ? 0 : 10);
  }
  if (kind == "cifar10" || kind == "cifar100") {
    const int classes = kind == "cifar10" ? 10 : 100;
    KILN_CHECK(!spec.root.empty(), InvalidArgument, "the ", kind,
               " dataset needs a directory "
               "(--data DIR) holding the extracted binary version");
    return std::make_shared<CifarDataset>(cifar_files(spec.root, spec.split, classes), classes,
                                          kind + " " + spec.split + " from " + spec.root);
  }
  if (kind == "folder") {
    KILN_CHECK(!spec.root.empty(), InvalidArgument,
               "an image-folder dataset needs a directory "
               "(--data DIR) holding <split>/<class>/*.jpg");
    return std::make_shared<ImageFolderDataset>(image_folder_split_dir(spec.root, spec.split),
                                                spec.channels, spec.skip_corrupt,
                                                spec.max_image_pixels);
  }
  KILN_FAIL(InvalidArgument, "unknown dataset kind '", kind, "'; valid kinds: ", kinds_list());
}

Normalization normalization_for(const std::string& kind, int64_t channels) {
  Normalization n;
  if (kind == "fashion-mnist") {
    n = {{0.2860f}, {0.3530f}};
  } else if (kind == "mnist") {
    n = {{0.1307f}, {0.3081f}};
  } else if (kind == "cifar10") {
    // Per-channel statistics of the 50,000 training images (std over all pixels).
    n = {{0.4914f, 0.4822f, 0.4465f}, {0.2470f, 0.2435f, 0.2616f}};
  } else if (kind == "cifar100") {
    n = {{0.5071f, 0.4865f, 0.4409f}, {0.2673f, 0.2564f, 0.2762f}};
  } else if (kind == "folder" || kind == "imagenet") {
    n = {{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}};
  } else if (kind == "synthetic") {
    // Uniform bytes: mean 1/2, std 1/sqrt(12).
    const int64_t c = channels > 0 ? channels : 3;
    n.mean.assign(static_cast<size_t>(c), 0.5f);
    n.std.assign(static_cast<size_t>(c), static_cast<float>(1.0 / std::sqrt(12.0)));
  } else if (kind == "idx") {
    KILN_FAIL(InvalidArgument,
              "no normalisation statistics for a generic idx dataset; use kind "
              "mnist or fashion-mnist if it is one of those, or give the mean and std yourself");
  } else {
    KILN_FAIL(InvalidArgument, "no normalisation statistics for dataset kind '", kind,
              "'; valid kinds: ", kinds_list());
  }
  if (channels > 0 && static_cast<int64_t>(n.mean.size()) != channels) {
    KILN_CHECK(n.mean.size() == 1, InvalidArgument, "the ", kind, " statistics have ",
               n.mean.size(), " channels, not the ", channels, " requested");
    n.mean.assign(static_cast<size_t>(channels), n.mean[0]);
    n.std.assign(static_cast<size_t>(channels), n.std[0]);
  }
  return n;
}

}  // namespace kiln

namespace kiln {

const char* decode_where_name(DecodeWhere d) {
  switch (d) {
    case DecodeWhere::automatic:
      return "auto";
    case DecodeWhere::gpu:
      return "gpu";
    case DecodeWhere::cpu:
      return "cpu";
  }
  return "?";
}

DecodeWhere parse_decode_where(const std::string& s) {
  if (s == "auto") return DecodeWhere::automatic;
  if (s == "gpu") return DecodeWhere::gpu;
  if (s == "cpu") return DecodeWhere::cpu;
  KILN_FAIL(InvalidArgument, "--decode ", s, " is not one of auto, gpu, cpu");
}

}  // namespace kiln
