// CIFAR-10 and CIFAR-100 in their binary form (https://www.cs.toronto.edu/~kriz/cifar.html):
// fixed-size records of label byte(s) then 3072 pixel bytes, 1024 per channel (CHW, 32x32).
// CIFAR-10 records have one label byte; CIFAR-100 two (coarse, fine), and kiln uses the fine
// label (100 classes), as torchvision's CIFAR100 does. Pixels are turned into HWC once, at load.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/dataset.h"

namespace kiln {

inline constexpr int64_t kCifarSide = 32;
inline constexpr int64_t kCifarPixels = 3 * kCifarSide * kCifarSide;  // 3072

struct CifarRecords {
  int64_t count = 0;
  std::vector<uint8_t> labels;  // count bytes
  std::vector<uint8_t> hwc;     // count * 32 * 32 * 3 bytes
};

// label_bytes: 1 (CIFAR-10) or 2 (CIFAR-100). An empty buffer, a size that is not a whole number
// of records, or a label >= num_classes is Error(Data) naming `what` and the record.
CifarRecords parse_cifar(const uint8_t* bytes, size_t size, int label_bytes, int num_classes,
                         const std::string& what);

class CifarDataset : public Dataset {
 public:
  // classes: 10 or 100. Reads every file now (CIFAR is small: 180 MB at most).
  CifarDataset(const std::vector<std::string>& files, int classes, std::string description);
  // From records already in memory (tests, fuzzing).
  CifarDataset(CifarRecords records, int classes, std::string description);

  int64_t size() const override { return records_.count; }
  int64_t num_classes() const override { return classes_; }
  Sample sample(int64_t index) const override;
  std::string describe() const override { return description_; }

 private:
  CifarRecords records_;
  int classes_ = 10;
  std::string description_;
};

// The files of a split under root (or root/cifar-10-batches-bin, root/cifar-100-binary):
// cifar10 train = data_batch_1..5.bin, test = test_batch.bin; cifar100 train.bin / test.bin.
// A missing file is Error(Data) naming it and where to download the binary version.
std::vector<std::string> cifar_files(const std::string& root, const std::string& split,
                                     int classes);

}  // namespace kiln
