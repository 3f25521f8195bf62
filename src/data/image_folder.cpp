#include "kiln/data/image_folder.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "data/file_bytes.h"
#include "kiln/core/error.h"
#include "kiln/core/log.h"
#include "kiln/data/image_codec.h"

namespace kiln {
namespace fs = std::filesystem;

namespace {

bool is_image_file(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

}  // namespace

std::string image_folder_split_dir(const std::string& root, const std::string& split) {
  KILN_CHECK(fs::is_directory(root), Data, "image folder root '", root, "'",
             " is not a directory; point --data at a directory holding <split>/<class>/*.jpg");
  const fs::path dir = fs::path(root) / split;
  if (fs::is_directory(dir)) return dir.string();
  // ImageNet calls its evaluation split "val", many others "test"; accept either name.
  const std::string other = split == "val" ? "test" : split == "test" ? "val" : "";
  if (!other.empty() && fs::is_directory(fs::path(root) / other)) {
    return (fs::path(root) / other).string();
  }
  KILN_FAIL(Data, "image folder split directory '", dir.string(), "' does not exist",
            other.empty() ? "" : " (nor '" + (fs::path(root) / other).string() + "')",
            "; expected ", root, "/<split>/<class>/*.jpg with split train, val or test");
}

ImageFolderDataset::ImageFolderDataset(const std::string& dir, int64_t channels, bool skip_corrupt,
                                       int64_t max_pixels)
    : dir_(dir), channels_(channels), skip_corrupt_(skip_corrupt), max_pixels_(max_pixels) {
  KILN_CHECK(channels == 1 || channels == 3, InvalidArgument,
             "image folders decode to 1 or 3 channels, not ", channels);
  KILN_CHECK(fs::is_directory(dir), Data, "image folder '", dir, "'",
             " is not a directory; expected <root>/<split>/<class>/*.jpg");
  try {
    list_files(dir);
  } catch (const fs::filesystem_error& e) {
    // A symlink loop (ELOOP), an unreadable sub-directory (EACCES), a name too long.
    KILN_FAIL(Data, "cannot list image folder '", dir, "': ", e.code().message(), " at '",
              e.path1().string(), "'",
              e.code() == std::errc::too_many_symbolic_link_levels ? " (a symbolic link loop)" : "",
              "; remove or fix that entry, or point --data elsewhere");
  }
  corrupt_ = std::make_unique<std::atomic<uint8_t>[]>(files_.size());
  for (size_t i = 0; i < files_.size(); ++i) corrupt_[i].store(0, std::memory_order_relaxed);
}

void ImageFolderDataset::list_files(const std::string& dir) {
  for (const auto& entry :
       fs::directory_iterator(dir, fs::directory_options::follow_directory_symlink)) {
    if (entry.is_directory()) classes_.push_back(entry.path().filename().string());
  }
  KILN_CHECK(!classes_.empty(), Data, "image folder '", dir, "'",
             " has no class sub-directories; expected '", dir, "/<class>/*.jpg'");
  std::sort(classes_.begin(), classes_.end());
  for (size_t c = 0; c < classes_.size(); ++c) {
    std::vector<std::string> found;
    const fs::path class_dir = fs::path(dir) / classes_[c];
    for (const auto& entry : fs::recursive_directory_iterator(
             class_dir, fs::directory_options::follow_directory_symlink)) {
      if (entry.is_regular_file() && is_image_file(entry.path())) {
        found.push_back(entry.path().string());
      }
    }
    KILN_CHECK(!found.empty(), Data, "class directory '", class_dir.string(), "'",
               " holds no .jpg, .jpeg or .png file; remove it or add its images");
    std::sort(found.begin(), found.end());
    files_.insert(files_.end(), found.begin(), found.end());
    labels_.insert(labels_.end(), found.size(), static_cast<int32_t>(c));
  }
}

std::string ImageFolderDataset::describe() const {
  return "image folder " + dir_ + ": " + std::to_string(files_.size()) + " images in " +
         std::to_string(classes_.size()) + " classes, decoded to " + std::to_string(channels_) +
         " channel(s)";
}

int64_t ImageFolderDataset::corrupt_skipped() const {
  return corrupt_count_.load(std::memory_order_relaxed);
}

bool ImageFolderDataset::known_corrupt(int64_t index) const {
  return corrupt_[static_cast<size_t>(index)].load(std::memory_order_relaxed) != 0;
}

void ImageFolderDataset::mark_corrupt(int64_t index, const std::string& message) const {
  KILN_CHECK(index >= 0 && index < size(), InvalidArgument, "mark_corrupt: index ", index,
             " is outside [0, ", size(), ") of ", describe());
  if (!skip_corrupt_) {
    KILN_FAIL(Data, message,
              "; delete or replace the file, or let kiln skip corrupt images "
              "(DatasetSpec::skip_corrupt = true)");
  }
  if (corrupt_[static_cast<size_t>(index)].exchange(1) == 0) {
    corrupt_count_.fetch_add(1, std::memory_order_relaxed);
    log_warn("skipping corrupt image (replaced by the next good one): ", message);
  }
}

bool ImageFolderDataset::try_decode(int64_t index, Image& out) const {
  const std::string& path = files_[static_cast<size_t>(index)];
  try {
    const std::vector<uint8_t> bytes = data_detail::read_file_bytes(path);
    out = decode_image(bytes.data(), bytes.size(), channels_, path, max_pixels_);
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Data) throw;
    mark_corrupt(index, e.what());
    return false;
  }
}

bool ImageFolderDataset::try_read(int64_t index, Encoded& out) const {
  const std::string& path = files_[static_cast<size_t>(index)];
  try {
    out.bytes = data_detail::read_file_bytes(path);
    const ImageInfo info = read_image_info(out.bytes.data(), out.bytes.size(), path);
    // Refused here, before any decoder sizes a buffer from the header (a decompression bomb).
    KILN_CHECK(info.height > 0 && info.width > 0 && info.height <= max_pixels_ / info.width, Data,
               "'", path, "' declares ", info.height, "x", info.width,
               " pixels, more than the limit of ", max_pixels_,
               " (a corrupt or hostile header; --max-image-pixels raises the limit)");
    out.index = index;
    out.label = labels_[static_cast<size_t>(index)];
    out.name = path;
    out.height = info.height;
    out.width = info.width;
    // Progressive JPEGs go to the loader's workers: the hardware engines refuse them, and
    // nvJPEG's hybrid decoder would run their Huffman decoding on the one staging thread
    // (1,894 images/s on the H200, bench/RESULTS.md), where 16 workers decode them in parallel.
    out.device_decodable =
        info.format == ImageFormat::Jpeg && !info.cmyk && info.complete && !info.progressive;
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Data) throw;
    mark_corrupt(index, e.what());
    return false;
  }
}

Dataset::Encoded ImageFolderDataset::encoded(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), InvalidArgument, "sample index ", index,
             " is outside [0, ", size(), ") of ", describe());
  Encoded e;
  const int64_t n = size();
  for (int64_t step = 0; step < n; ++step) {
    const int64_t j = (index + step) % n;
    if (known_corrupt(j)) continue;
    if (try_read(j, e)) return e;
  }
  KILN_FAIL(Data, "every image in '", dir_, "' is corrupt (", n,
            " files); check the files, e.g. with `file` or an image viewer");
}

Sample ImageFolderDataset::sample(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), InvalidArgument, "sample index ", index,
             " is outside [0, ", size(), ") of ", describe());
  Sample s;
  const int64_t n = size();
  for (int64_t step = 0; step < n; ++step) {
    const int64_t j = (index + step) % n;
    if (known_corrupt(j)) continue;
    if (try_decode(j, s.image)) {
      s.label = labels_[static_cast<size_t>(j)];
      return s;
    }
  }
  KILN_FAIL(Data, "every image in '", dir_, "' is corrupt (", n,
            " files); check the files, e.g. with `file` or an image viewer");
}

}  // namespace kiln
