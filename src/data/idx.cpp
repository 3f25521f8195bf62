#include "kiln/data/idx.h"

#include <algorithm>
#include <filesystem>

#include "data/file_bytes.h"
#include "kiln/core/error.h"

namespace kiln {
namespace {

constexpr uint8_t kIdxUnsignedByte = 0x08;
// Fashion-MNIST's training images inflate to 47 MB; anything past 4 GiB is not an IDX dataset.
constexpr size_t kMaxIdxBytes = size_t{4} << 30;

uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

const char* idx_type_name(uint8_t t) {
  switch (t) {
    case 0x08:
      return "unsigned byte";
    case 0x09:
      return "signed byte";
    case 0x0B:
      return "int16";
    case 0x0C:
      return "int32";
    case 0x0D:
      return "float32";
    case 0x0E:
      return "float64";
    default:
      return "unknown";
  }
}

std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? " x " : "") + std::to_string(dims[i]);
  return s;
}

IdxArray parse_raw_idx(const uint8_t* bytes, size_t size, const std::string& what) {
  KILN_CHECK(size >= 4, Data, "'", what, "': too short for an IDX file (", size,
             " bytes, the header alone needs 4+); the file is truncated, download it again");
  KILN_CHECK(bytes[0] == 0 && bytes[1] == 0, Data, "'", what, "': not an IDX file (magic ",
             static_cast<int>(bytes[0]), " ", static_cast<int>(bytes[1]),
             ", expected 0 0, or 0x1f 0x8b for gzip); check that --data points at the MNIST-style "
             "idx files");
  const uint8_t type = bytes[2];
  KILN_CHECK(type == kIdxUnsignedByte, Data, "'", what, "': IDX element type 0x", std::hex,
             static_cast<int>(type), std::dec, " (", idx_type_name(type),
             ") is not supported; kiln reads unsigned-byte (0x08) image and label files");
  const int ndims = bytes[3];
  KILN_CHECK(ndims >= 1 && ndims <= 4, Data, "'", what, "': IDX header says ", ndims,
             " dimensions; image files have 3 (N x H x W) or 4, label files 1");
  const size_t header = 4 + 4 * static_cast<size_t>(ndims);
  KILN_CHECK(size >= header, Data, "'", what, "': truncated IDX header (", size, " bytes, ", header,
             " needed for ", ndims, " dimensions); download the file again");

  IdxArray out;
  uint64_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    const uint32_t d = read_be32(bytes + 4 + 4 * i);
    out.dims.push_back(d);
    total *= d;  // each factor < 2^32 and we stop at 2^32 below, so no overflow
    KILN_CHECK(total <= kMaxIdxBytes, Data, "'", what, "': IDX dimensions ", dims_str(out.dims),
               "... describe more than ", kMaxIdxBytes, " bytes; the header is corrupt");
  }
  const size_t body = size - header;
  KILN_CHECK(body >= total, Data, "'", what, "': truncated: the header says ", dims_str(out.dims),
             " = ", total, " bytes of data but the file has only ", body,
             "; the download was probably interrupted, download it again");
  KILN_CHECK(body == total, Data, "'", what, "': ", body - total, " unexpected bytes after the ",
             dims_str(out.dims), " array; the file is not a single IDX array, check it");
  out.data.assign(bytes + header, bytes + header + total);
  return out;
}

}  // namespace

IdxArray parse_idx(const uint8_t* bytes, size_t size, const std::string& what) {
  if (data_detail::is_gzip(bytes, size)) {
    // Inflate once only: the gunzipped bytes are parsed as IDX even if they look like gzip
    // again, so a gzip "quine" cannot recurse forever.
    const std::vector<uint8_t> raw = data_detail::gunzip(bytes, size, what, kMaxIdxBytes);
    return parse_raw_idx(raw.data(), raw.size(), what + " (after gunzip)");
  }
  return parse_raw_idx(bytes, size, what);
}

IdxArray read_idx(const std::string& path) {
  const std::vector<uint8_t> bytes = data_detail::read_file_bytes(path);
  return parse_idx(bytes.data(), bytes.size(), path);
}

IdxDataset::IdxDataset(IdxArray images, IdxArray labels, const std::string& images_what,
                       const std::string& labels_what, std::string name, int64_t classes)
    : images_(std::move(images)) {
  const auto& d = images_.dims;
  KILN_CHECK(d.size() == 3 || d.size() == 4, Data, "'", images_what,
             "': an image file must have 3 "
             "(N x H x W) or 4 (N x H x W x C) dimensions, it has ",
             dims_str(d), "; did you swap the images and labels files?");
  KILN_CHECK(labels.dims.size() == 1, Data, "'", labels_what,
             "': a label file must have 1 dimension "
             "(N), it has ",
             dims_str(labels.dims), "; did you swap the images and labels files?");
  count_ = d[0];
  height_ = d[1];
  width_ = d[2];
  channels_ = d.size() == 4 ? d[3] : 1;
  KILN_CHECK(count_ > 0 && height_ > 0 && width_ > 0 && channels_ > 0, Data, "'", images_what,
             "': empty image array (", dims_str(d), "); the file is corrupt");
  KILN_CHECK(labels.dims[0] == count_, Data, "IDX files disagree: ", images_what, " holds ", count_,
             " images but ", labels_what, " holds ", labels.dims[0],
             " labels; they must come from the same split (train-* with train-*, t10k-* with "
             "t10k-*)");
  labels_ = std::move(labels.data);
  if (classes > 0) {
    // One bad label byte would otherwise grow the model by up to 246 classes, silently.
    for (size_t i = 0; i < labels_.size(); ++i) {
      KILN_CHECK(labels_[i] < classes, Data, "'", labels_what, "': label ", int{labels_[i]},
                 " at index ", i, " is outside 0..", classes - 1, " (", name, " has ", classes,
                 " classes); the file is corrupt, download it again");
    }
    num_classes_ = classes;
  } else {
    num_classes_ = 1 + *std::max_element(labels_.begin(), labels_.end());
  }
  description_ = name + ": " + std::to_string(count_) + " images of " + std::to_string(height_) +
                 "x" + std::to_string(width_) + "x" + std::to_string(channels_) + " from " +
                 images_what;
}

std::shared_ptr<IdxDataset> IdxDataset::open(const std::string& images_path,
                                             const std::string& labels_path, std::string name,
                                             int64_t classes) {
  IdxArray images = read_idx(images_path);  // in this order, so errors name the images first
  IdxArray labels = read_idx(labels_path);
  return std::make_shared<IdxDataset>(std::move(images), std::move(labels), images_path,
                                      labels_path, std::move(name), classes);
}

Sample IdxDataset::sample(int64_t index) const {
  KILN_CHECK(index >= 0 && index < count_, InvalidArgument, "sample index ", index,
             " is outside [0, ", count_, ") of ", description_);
  Sample s;
  s.image.height = height_;
  s.image.width = width_;
  s.image.channels = channels_;
  const size_t n = static_cast<size_t>(height_ * width_ * channels_);
  const auto first = images_.data.begin() + static_cast<std::ptrdiff_t>(n * index);
  s.image.pixels.assign(first, first + static_cast<std::ptrdiff_t>(n));
  s.label = labels_[static_cast<size_t>(index)];
  return s;
}

std::string mnist_file(const std::string& root, const std::string& split, bool images) {
  KILN_CHECK(split == "train" || split == "test" || split == "val", InvalidArgument,
             "unknown split '", split, "' for an MNIST-style dataset; use train or test");
  const std::string base = std::string(split == "train" ? "train" : "t10k") +
                           (images ? "-images-idx3-ubyte" : "-labels-idx1-ubyte");
  const std::filesystem::path dir(root);
  for (const std::string& name : {base + ".gz", base}) {
    const auto p = dir / name;
    if (std::filesystem::exists(p)) return p.string();
  }
  KILN_FAIL(Data, "missing data file: expected ", (dir / (base + ".gz")).string(), " or ",
            (dir / base).string(), "; point --data at the directory holding the ",
            "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] files");
}

}  // namespace kiln
