// safetensors reader and writer; the format and the ordering rules are in the header.
// The reader is strict on purpose: a checkpoint that is in any way malformed is refused with
// one error that names the file and the problem, rather than loaded half right.
#include "kiln/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <span>
#include <string_view>

#include "io/json_cursor.h"
#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/io/json.h"

namespace kiln {
namespace {

// The Python library refuses larger headers (safetensors/src/tensor.rs, MAX_HEADER_SIZE), so a
// larger length field means a corrupt file, not a big model; refusing it early also keeps a
// corrupt length from asking for 2^64 bytes.
constexpr uint64_t kMaxHeaderSize = 100'000'000;
constexpr uint64_t kMaxInt64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
constexpr const char* kMetadataKey = "__metadata__";

const char* const kCorruptFix =
    ". The file is corrupt, truncated or not a safetensors file: write it again, or check the path";

// Rank of a dtype in the Rust library's `Dtype` enum (BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16,
// F16, BF16, I32, U32, F32, F64, I64, U64). The writer sorts by this rank, largest first, so
// that every tensor starts aligned to its element size; we sort the same way to write the same
// bytes.
int python_dtype_rank(DType t) {
  switch (t) {
    case DType::U8:
      return 1;
    case DType::F16:
      return 7;
    case DType::BF16:
      return 8;
    case DType::I32:
      return 9;
    case DType::F32:
      return 11;
    case DType::I64:
      return 13;
  }
  return 0;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// numel(shape) * dtype_size, or false when it does not fit in 63 bits.
bool byte_size(const std::vector<int64_t>& shape, DType dtype, uint64_t* out) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) return false;
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > kMaxInt64 / ud) return false;
    n *= ud;
  }
  *out = n;
  return true;
}

// One tensor as the header describes it, before its bytes are copied out.
struct Entry {
  std::string name;
  StTensor info;  // data still empty
  uint64_t begin = 0;
  uint64_t end = 0;
};

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void append_le64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Parses one tensor's `{"dtype": .., "shape": [..], "data_offsets": [b, e]}`.
Entry read_entry(detail::JsonCursor& cur, const std::string& name) {
  Entry e;
  e.name = name;
  bool have_dtype = false, have_shape = false, have_offsets = false;
  const size_t start = cur.pos();
  cur.read_object(
      detail::concat("for the value of tensor '", name, "'"), [&](const std::string& key) {
        if (key == "dtype") {
          if (have_dtype) cur.fail(detail::concat("tensor '", name, "' has two \"dtype\" fields"));
          have_dtype = true;
          const size_t at = cur.pos();
          const std::string dt = cur.read_string("as the dtype");
          if (!dtype_from_safetensors_name(dt, &e.info.dtype)) {
            cur.fail_at(at,
                        detail::concat("tensor '", name, "' has dtype '", dt,
                                       "', which kiln does not support (it reads F32, F16, BF16, "
                                       "I32, U8, I64); convert it before loading"));
          }
        } else if (key == "shape") {
          if (have_shape) cur.fail(detail::concat("tensor '", name, "' has two \"shape\" fields"));
          have_shape = true;
          cur.read_array("for the shape", [&] {
            e.info.shape.push_back(static_cast<int64_t>(cur.read_uint("in the shape", kMaxInt64)));
          });
        } else if (key == "data_offsets") {
          if (have_offsets)
            cur.fail(detail::concat("tensor '", name, "' has two \"data_offsets\" fields"));
          have_offsets = true;
          const size_t at = cur.pos();
          int count = 0;
          cur.read_array("for data_offsets", [&] {
            const uint64_t v = cur.read_uint("in data_offsets", kMaxInt64);
            if (count == 0) e.begin = v;
            if (count == 1) e.end = v;
            ++count;
          });
          if (count != 2) {
            cur.fail_at(at, detail::concat("tensor '", name, "' has ", count,
                                           " data_offsets; it needs exactly two: [begin, end]"));
          }
        } else {
          cur.fail(detail::concat("tensor '", name, "' has an unknown field \"", key,
                                  "\" (a tensor has only dtype, shape and data_offsets)"));
        }
      });
  if (!have_dtype || !have_shape || !have_offsets) {
    cur.fail_at(start, detail::concat("tensor '", name, "' lacks ",
                                      !have_dtype   ? "\"dtype\""
                                      : !have_shape ? "\"shape\""
                                                    : "\"data_offsets\""));
  }
  return e;
}

// The header text (length prefix and padding included) and the tensors in data order.
struct Layout {
  std::vector<uint8_t> header;
  std::vector<const std::pair<const std::string, StTensor>*> order;
  uint64_t data_size = 0;
};

Layout layout(const StFile& file) {
  Layout out;
  for (const auto& kv : file.tensors) {
    const std::string& name = kv.first;
    const StTensor& t = kv.second;
    // The reader (Python's and kiln's) refuses a header that is not UTF-8; refuse to write one.
    KILN_CHECK(detail::find_invalid_utf8(name) == std::string_view::npos, InvalidArgument,
               "cannot write tensor '", name, "': its name is not valid UTF-8");
    KILN_CHECK(name != kMetadataKey, InvalidArgument, "cannot write a tensor named '", kMetadataKey,
               "': safetensors reserves that name for the metadata; rename the tensor");
    uint64_t nbytes = 0;
    KILN_CHECK(byte_size(t.shape, t.dtype, &nbytes), InvalidArgument, "cannot write tensor '", name,
               "': its shape ", shape_text(t.shape), " has a negative dimension or is too large");
    KILN_CHECK(nbytes == t.data.size(), InvalidArgument, "cannot write tensor '", name,
               "': ", dtype_safetensors_name(t.dtype), " ", shape_text(t.shape), " needs ", nbytes,
               " bytes but its data has ", t.data.size(), "; fix the shape or the data");
    out.order.push_back(&kv);
  }
  // Largest dtype first, then by name (std::string compares bytes as unsigned char, as Rust's
  // String does), exactly as the Python library sorts before writing.
  std::stable_sort(out.order.begin(), out.order.end(), [](const auto* a, const auto* b) {
    const int ra = python_dtype_rank(a->second.dtype), rb = python_dtype_rank(b->second.dtype);
    if (ra != rb) return ra > rb;
    return a->first < b->first;
  });

  for (const auto& [k, v] : file.metadata) {
    KILN_CHECK(detail::find_invalid_utf8(k) == std::string_view::npos &&
                   detail::find_invalid_utf8(v) == std::string_view::npos,
               InvalidArgument, "cannot write metadata '", k, "': it is not valid UTF-8");
  }

  // The same compact text serde_json writes: no spaces, keys in this order.
  std::string json = "{";
  bool first = true;
  if (!file.metadata.empty()) {
    json += json_string(kMetadataKey) + ":{";
    for (const auto& [k, v] : file.metadata) {
      if (!first) json += ',';
      first = false;
      json += json_string(k) + ":" + json_string(v);
    }
    json += '}';
    first = false;
  }
  for (const auto* kv : out.order) {
    const StTensor& t = kv->second;
    if (!first) json += ',';
    first = false;
    json += json_string(kv->first) + ":{\"dtype\":\"" + dtype_safetensors_name(t.dtype) +
            "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) json += ',';
      json += std::to_string(t.shape[i]);
    }
    json += "],\"data_offsets\":[" + std::to_string(out.data_size) + ",";
    out.data_size += t.data.size();
    json += std::to_string(out.data_size) + "]}";
  }
  json += '}';
  // Pad with spaces so the data starts 8-byte aligned, as the Python library does.
  json.append((8 - json.size() % 8) % 8, ' ');
  out.header.reserve(8 + json.size());
  append_le64(out.header, json.size());
  out.header.insert(out.header.end(), json.begin(), json.end());
  return out;
}

// Read-only view of a whole file, mmapped so a large checkpoint is not held twice in memory.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    KILN_CHECK(fd >= 0, Io, "cannot open checkpoint '", path, "': ", std::strerror(errno),
               "; check the path");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      KILN_FAIL(Io, "cannot read checkpoint '", path,
                "': it is not a regular file; check the path");
    }
    size_ = static_cast<size_t>(st.st_size);
    void* p = size_ > 0 ? ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    ::close(fd);
    if (p != MAP_FAILED) {
      mapped_ = static_cast<const uint8_t*>(p);
    } else if (size_ > 0) {
      // Some file systems (a few FUSE mounts) cannot map files; read them instead.
      copy_ = read_file_bytes(path);
      size_ = copy_.size();
    }
  }
  ~MappedFile() {
    if (mapped_) ::munmap(const_cast<uint8_t*>(mapped_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return mapped_ ? mapped_ : copy_.data(); }
  size_t size() const { return size_; }

 private:
  const uint8_t* mapped_ = nullptr;
  std::vector<uint8_t> copy_;
  size_t size_ = 0;
};

}  // namespace

StFile parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what) {
  const std::string prefix = "checkpoint '" + what + "': ";
  KILN_CHECK(size >= 8, Checkpoint, prefix, "the file has ", size,
             " bytes, fewer than the 8-byte header length", kCorruptFix);
  const uint64_t n = read_le64(bytes);
  KILN_CHECK(n <= kMaxHeaderSize, Checkpoint, prefix, "header length ", n,
             " is larger than the 100 MB safetensors allows", kCorruptFix);
  KILN_CHECK(n <= size - 8, Checkpoint, prefix, "header length ", n, " is larger than the file (",
             size, " bytes)", kCorruptFix);
  KILN_CHECK(n >= 2, Checkpoint, prefix, "header length ", n, " is too short for a JSON object",
             kCorruptFix);
  const std::string_view header(reinterpret_cast<const char*>(bytes + 8), static_cast<size_t>(n));
  const size_t bad = detail::find_invalid_utf8(header);
  KILN_CHECK(bad == std::string_view::npos, Checkpoint, prefix, "byte ", bad,
             " of the JSON header is not valid UTF-8", kCorruptFix);
  // Like newer safetensors releases, insist on '{' first: a file that starts otherwise is almost
  // always some other format whose first 8 bytes happened to pass as a length.
  KILN_CHECK(header[0] == '{', Checkpoint, prefix, "the JSON header does not start with '{'",
             kCorruptFix);

  detail::JsonCursor cur(header, ErrorKind::Checkpoint, prefix, kCorruptFix);
  StFile file;
  std::vector<Entry> entries;
  std::set<std::string> names;
  cur.read_object("at the start of the header", [&](const std::string& key) {
    if (!names.insert(key).second) {
      cur.fail(detail::concat(key == kMetadataKey ? "the header has two \"__metadata__\" entries"
                                                  : "tensor name '" + key + "' appears twice"));
    }
    if (key == kMetadataKey) {
      cur.read_object("for __metadata__", [&](const std::string& k) {
        const size_t at = cur.pos();
        std::string v = cur.read_string("as a metadata value (metadata values are strings)");
        if (!file.metadata.emplace(k, std::move(v)).second) {
          cur.fail_at(at, detail::concat("metadata key '", k, "' appears twice"));
        }
      });
    } else {
      entries.push_back(read_entry(cur, key));
    }
  });
  KILN_CHECK(cur.at_end(), Checkpoint, prefix, "byte ", cur.pos(),
             " of the JSON header: unexpected characters after the header's closing '}'",
             kCorruptFix);

  // Each tensor on its own: offsets in order, inside the data, and as long as dtype x shape.
  const uint64_t data_size = size - 8 - n;
  for (const Entry& e : entries) {
    const std::string t = detail::concat("tensor '", e.name, "' ");
    KILN_CHECK(e.begin <= e.end, Checkpoint, prefix, t, "has data_offsets [", e.begin, ", ", e.end,
               "] that end before they begin", kCorruptFix);
    KILN_CHECK(e.end <= data_size, Checkpoint, prefix, t, "has data_offsets [", e.begin, ", ",
               e.end, "] past the end of the data (", data_size, " bytes): the file is truncated",
               kCorruptFix);
    uint64_t nbytes = 0;
    KILN_CHECK(byte_size(e.info.shape, e.info.dtype, &nbytes), Checkpoint, prefix, t, "has shape ",
               shape_text(e.info.shape), ", too large to address", kCorruptFix);
    KILN_CHECK(e.end - e.begin == nbytes, Checkpoint, prefix, t, "is ",
               dtype_safetensors_name(e.info.dtype), " ", shape_text(e.info.shape), " (", nbytes,
               " bytes) but its data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin,
               " bytes", kCorruptFix);
  }
  // Together: in offset order the tensors must tile the data exactly, with no overlap, no gap
  // and nothing after the last one (the Python library checks the same).
  std::vector<const Entry*> sorted;
  for (const Entry& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : sorted) {
    KILN_CHECK(e->begin >= cursor, Checkpoint, prefix, "tensor '", e->name, "' (data_offsets [",
               e->begin, ", ", e->end, "]) overlaps tensor '", prev ? prev->name : "",
               "' (data_offsets [", prev ? prev->begin : 0, ", ", prev ? prev->end : 0, "])",
               kCorruptFix);
    KILN_CHECK(e->begin == cursor, Checkpoint, prefix, "the data has a gap of ", e->begin - cursor,
               " bytes before tensor '", e->name, "' (data_offsets must be contiguous)",
               kCorruptFix);
    cursor = e->end;
    prev = e;
  }
  KILN_CHECK(cursor == data_size, Checkpoint, prefix, "the file has ", data_size - cursor,
             " bytes after the last tensor's data (trailing garbage)", kCorruptFix);

  const uint8_t* data = bytes + 8 + n;
  for (Entry& e : entries) {
    e.info.data.assign(data + e.begin, data + e.end);
    file.tensors.emplace(std::move(e.name), std::move(e.info));
  }
  return file;
}

StFile read_safetensors(const std::string& path) {
  const MappedFile mapped(path);
  return parse_safetensors(mapped.data(), mapped.size(), path);
}

std::vector<uint8_t> serialize_safetensors(const StFile& file) {
  const Layout l = layout(file);
  std::vector<uint8_t> out;
  out.reserve(l.header.size() + l.data_size);
  out.insert(out.end(), l.header.begin(), l.header.end());
  for (const auto* kv : l.order)
    out.insert(out.end(), kv->second.data.begin(), kv->second.data.end());
  return out;
}

void write_safetensors(const std::string& path, const StFile& file) {
  // Header and each tensor's bytes go to the file as they are: a multi-GB checkpoint is never
  // copied into one buffer first.
  const Layout l = layout(file);
  std::vector<std::span<const uint8_t>> pieces;
  pieces.reserve(1 + l.order.size());
  pieces.emplace_back(l.header);
  for (const auto* kv : l.order) pieces.emplace_back(kv->second.data);
  write_file_atomic(path, pieces);
}

}  // namespace kiln
