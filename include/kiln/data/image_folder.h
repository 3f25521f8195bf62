// An image-folder tree, as torchvision's ImageFolder reads it: root/<split>/<class>/**/*.{jpg,
// jpeg,png} (extensions in any case: ImageNet's are .JPEG). Classes are the sub-directories
// sorted by name (label = position); files are found recursively and sorted by path, so the
// index -> file mapping is the same on every machine. Other files are ignored; a class with no
// image is an error (as ImageFolder's default). Files are listed at construction and decoded
// lazily in sample().
//
// Corrupt files (skip_corrupt = true, the default): a file that cannot be read or decoded is
// logged once (a warning naming it), counted (corrupt_skipped(), which the Loader reports), and
// replaced by the next good file in index order (wrapping around), with that file's own label.
// Why replace rather than fail: a days-long ImageNet run should not die at hour 30 on one bad
// JPEG, and the Loader's batches must stay full because the compiled step has a fixed batch
// size. Why the next file rather than a random one: the replacement depends only on the tree, so
// runs stay reproducible whatever the worker count. With skip_corrupt = false the first corrupt
// file is Error(Data) naming it and telling how to skip such files instead.
//
// encoded() reads a file and its header without decoding (the uint8 and GPU paths decode
// later); a header that fails, or declares more than the dataset's pixel limit, is corrupt there
// too. A decoder that later fails on the pixels calls mark_corrupt(), with the same warning and
// count, and asks for the next file: the replacement sample() would have made.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/data/dataset.h"
#include "kiln/data/image_codec.h"

namespace kiln {

class ImageFolderDataset : public Dataset {
 public:
  // dir is root/<split>; channels 1 or 3. An image of more than max_pixels is corrupt (skipped
  // and counted as such when skip_corrupt is on).
  ImageFolderDataset(const std::string& dir, int64_t channels, bool skip_corrupt,
                     int64_t max_pixels = kMaxDecodePixels);

  int64_t size() const override { return static_cast<int64_t>(files_.size()); }
  int64_t num_classes() const override { return static_cast<int64_t>(classes_.size()); }
  Sample sample(int64_t index) const override;
  std::string describe() const override;
  int64_t corrupt_skipped() const override;
  bool has_encoded() const override { return true; }
  Encoded encoded(int64_t index) const override;
  void mark_corrupt(int64_t index, const std::string& message) const override;
  int64_t channels() const override { return channels_; }

  const std::vector<std::string>& classes() const { return classes_; }
  const std::string& dir() const { return dir_; }
  const std::string& file(int64_t index) const { return files_[static_cast<size_t>(index)]; }
  int32_t label(int64_t index) const { return labels_[static_cast<size_t>(index)]; }

 private:
  // Fills classes_, files_ and labels_ from dir (std::filesystem errors pass through).
  void list_files(const std::string& dir);
  // Decodes file `index`; returns false (and records it) when it is corrupt and skipping is on.
  bool try_decode(int64_t index, Image& out) const;
  // Reads file `index` and its header; false (and recorded) as try_decode.
  bool try_read(int64_t index, Encoded& out) const;
  bool known_corrupt(int64_t index) const;

  std::string dir_;
  int64_t channels_;
  bool skip_corrupt_;
  int64_t max_pixels_;
  std::vector<std::string> classes_;
  std::vector<std::string> files_;
  std::vector<int32_t> labels_;
  // One flag per file found corrupt; atomics because every worker reads and may set them, and
  // exchange() makes the warning appear once per file.
  std::unique_ptr<std::atomic<uint8_t>[]> corrupt_;
  mutable std::atomic<int64_t> corrupt_count_{0};
};

// root/<split>, accepting "val" for "test" and the reverse when only the other exists.
std::string image_folder_split_dir(const std::string& root, const std::string& split);

}  // namespace kiln
