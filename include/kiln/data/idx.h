// IDX files (MNIST, Fashion-MNIST): a big-endian header — two zero bytes, a type byte, the
// number of dimensions, one uint32 per dimension — then the values in C order. kiln reads
// unsigned-byte arrays (type 0x08), plain or gzip-compressed (detected by the 0x1f 0x8b magic,
// not by the file name, because people gunzip files and keep the name or the reverse).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/dataset.h"

namespace kiln {

struct IdxArray {
  std::vector<int64_t> dims;  // e.g. {60000, 28, 28} for images, {60000} for labels
  std::vector<uint8_t> data;  // product(dims) bytes
};

// Parses IDX bytes in memory (gzip-compressed or not). `what` names them in errors (the path).
// Anything malformed — wrong magic, a type other than unsigned byte, zero or too many
// dimensions, a size that overflows, truncation, trailing bytes, a broken gzip stream — is
// Error(Data) naming `what`, the problem and the fix.
IdxArray parse_idx(const uint8_t* bytes, size_t size, const std::string& what);
IdxArray read_idx(const std::string& path);

// Images (N x H x W, or N x H x W x C) with labels (N), checked against each other.
class IdxDataset : public Dataset {
 public:
  // images_what / labels_what name the sources in errors; name is the kind for describe().
  // classes > 0 is the dataset's known class count (10 for MNIST and Fashion-MNIST): a label
  // at or above it is Error(Data) naming the file and the index. classes = 0 (a generic idx
  // file) takes 1 + the largest label.
  IdxDataset(IdxArray images, IdxArray labels, const std::string& images_what,
             const std::string& labels_what, std::string name, int64_t classes = 0);
  static std::shared_ptr<IdxDataset> open(const std::string& images_path,
                                          const std::string& labels_path, std::string name,
                                          int64_t classes = 0);

  int64_t size() const override { return count_; }
  int64_t num_classes() const override { return num_classes_; }
  Sample sample(int64_t index) const override;
  std::string describe() const override { return description_; }

 private:
  IdxArray images_;
  std::vector<uint8_t> labels_;
  int64_t count_ = 0, height_ = 0, width_ = 0, channels_ = 1, num_classes_ = 0;
  std::string description_;
};

// The MNIST file names under `root` for a split ("train" or "test"/"val"): the .gz file when
// present, else the plain one; Error(Data) naming both candidates when neither exists.
std::string mnist_file(const std::string& root, const std::string& split, bool images);

}  // namespace kiln
