#include "kiln/data/cifar.h"

#include <filesystem>

#include "data/file_bytes.h"
#include "kiln/core/error.h"

namespace kiln {

CifarRecords parse_cifar(const uint8_t* bytes, size_t size, int label_bytes, int num_classes,
                         const std::string& what) {
  KILN_CHECK(label_bytes == 1 || label_bytes == 2, InvalidArgument,
             "CIFAR records have 1 (CIFAR-10) or 2 (CIFAR-100) label bytes, not ", label_bytes);
  const size_t record = static_cast<size_t>(label_bytes) + kCifarPixels;
  KILN_CHECK(size > 0, Data, "'", what, "': empty CIFAR file; download the binary version again");
  KILN_CHECK(size % record == 0, Data, "'", what, "': ", size, " bytes is not a whole number of ",
             record, "-byte CIFAR-", num_classes, " records (", size / record, " records and ",
             size % record,
             " bytes left over); the file is truncated, or it is the other "
             "CIFAR (10 vs 100) or the Python version; download the binary version again");
  CifarRecords out;
  out.count = static_cast<int64_t>(size / record);
  out.labels.resize(static_cast<size_t>(out.count));
  out.hwc.resize(static_cast<size_t>(out.count * kCifarPixels));
  constexpr int64_t plane = kCifarSide * kCifarSide;
  for (int64_t r = 0; r < out.count; ++r) {
    const uint8_t* rec = bytes + static_cast<size_t>(r) * record;
    const uint8_t label = rec[label_bytes - 1];  // CIFAR-100: the fine label follows the coarse
    KILN_CHECK(label < num_classes, Data, "'", what, "': record ", r, " has label ",
               static_cast<int>(label), ", outside 0..", num_classes - 1,
               "; the file is corrupt or belongs to the other CIFAR (10 vs 100)");
    out.labels[static_cast<size_t>(r)] = label;
    const uint8_t* chw = rec + label_bytes;
    uint8_t* hwc = out.hwc.data() + r * kCifarPixels;
    for (int64_t p = 0; p < plane; ++p) {
      hwc[3 * p + 0] = chw[p];
      hwc[3 * p + 1] = chw[plane + p];
      hwc[3 * p + 2] = chw[2 * plane + p];
    }
  }
  return out;
}

CifarDataset::CifarDataset(CifarRecords records, int classes, std::string description)
    : records_(std::move(records)), classes_(classes), description_(std::move(description)) {
  KILN_CHECK(classes == 10 || classes == 100, InvalidArgument, "CIFAR has 10 or 100 classes, not ",
             classes);
  KILN_CHECK(records_.count > 0 && records_.labels.size() == static_cast<size_t>(records_.count) &&
                 records_.hwc.size() == static_cast<size_t>(records_.count * kCifarPixels),
             InvalidArgument, "inconsistent CIFAR records for ", description_);
}

CifarDataset::CifarDataset(const std::vector<std::string>& files, int classes,
                           std::string description)
    : classes_(classes), description_(std::move(description)) {
  KILN_CHECK(classes == 10 || classes == 100, InvalidArgument, "CIFAR has 10 or 100 classes, not ",
             classes);
  KILN_CHECK(!files.empty(), InvalidArgument, "no CIFAR files given for ", description_);
  for (const std::string& f : files) {
    const std::vector<uint8_t> bytes = data_detail::read_file_bytes(f);
    CifarRecords part = parse_cifar(bytes.data(), bytes.size(), classes == 10 ? 1 : 2, classes, f);
    records_.count += part.count;
    records_.labels.insert(records_.labels.end(), part.labels.begin(), part.labels.end());
    records_.hwc.insert(records_.hwc.end(), part.hwc.begin(), part.hwc.end());
  }
  description_ += ": " + std::to_string(records_.count) + " images of 32x32x3";
}

Sample CifarDataset::sample(int64_t index) const {
  KILN_CHECK(index >= 0 && index < records_.count, InvalidArgument, "sample index ", index,
             " is outside [0, ", records_.count, ") of ", description_);
  Sample s;
  s.image.height = kCifarSide;
  s.image.width = kCifarSide;
  s.image.channels = 3;
  const auto first = records_.hwc.begin() + static_cast<std::ptrdiff_t>(index * kCifarPixels);
  s.image.pixels.assign(first, first + kCifarPixels);
  s.label = records_.labels[static_cast<size_t>(index)];
  return s;
}

std::vector<std::string> cifar_files(const std::string& root, const std::string& split,
                                     int classes) {
  namespace fs = std::filesystem;
  KILN_CHECK(classes == 10 || classes == 100, InvalidArgument, "CIFAR has 10 or 100 classes, not ",
             classes);
  KILN_CHECK(split == "train" || split == "test" || split == "val", InvalidArgument,
             "unknown split '", split, "' for CIFAR; use train or test");
  const bool train = split == "train";
  std::vector<std::string> names;
  if (classes == 10) {
    if (train) {
      for (int i = 1; i <= 5; ++i) names.push_back("data_batch_" + std::to_string(i) + ".bin");
    } else {
      names.push_back("test_batch.bin");
    }
  } else {
    names.push_back(train ? "train.bin" : "test.bin");
  }
  // Accept the directory itself or the one the tarball was extracted into.
  fs::path dir(root);
  const fs::path nested = dir / (classes == 10 ? "cifar-10-batches-bin" : "cifar-100-binary");
  if (!fs::exists(dir / names[0]) && fs::exists(nested / names[0])) dir = nested;
  std::vector<std::string> files;
  for (const std::string& n : names) {
    const fs::path p = dir / n;
    KILN_CHECK(fs::exists(p), Data, "missing CIFAR-", classes, " file '", p.string(), "'",
               "; point --data at the extracted binary version (cifar-", classes,
               classes == 10 ? "-binary.tar.gz, directory cifar-10-batches-bin"
                             : "-binary.tar.gz, directory cifar-100-binary",
               ") from https://www.cs.toronto.edu/~kriz/cifar.html");
    files.push_back(p.string());
  }
  return files;
}

}  // namespace kiln
