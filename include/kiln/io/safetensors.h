// safetensors files, byte for byte as huggingface's safetensors library writes and reads them
// (checkpoints that load elsewhere). Layout: an 8-byte little-endian header length N,
// N bytes of JSON header padded with spaces to a multiple of 8, then the tensors' bytes back to
// back with no gaps:
//   {"__metadata__":{"k":"v"},"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},...}
// Order, as the Python library writes it: tensors by dtype alignment, largest first
// (I64, F32, I32, BF16, F16, U8), then by name; the header lists them in data order.
// kiln writes __metadata__ keys sorted; Python writes them in hash order, so a file with two or
// more metadata keys matches Python's only up to that order (one key or none: identical bytes).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kiln/core/dtype.h"

namespace kiln {

struct StTensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // [] is a scalar (one element)
  std::vector<uint8_t> data;   // little-endian, C order; size = numel(shape) * dtype_size(dtype)
};

struct StFile {
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (strings only)
};

// Reads and checks a whole file. A missing or unreadable file is Error(Io); a file that is not
// well-formed safetensors (truncated, bad header, offsets that overlap, leave gaps or run past
// the end, a size that disagrees with dtype x shape, a dtype kiln lacks, duplicate names,
// trailing bytes) is Error(Checkpoint) naming the file and the problem.
StFile read_safetensors(const std::string& path);

// The same checks on bytes in memory; `what` names them in errors (usually the path).
StFile parse_safetensors(const uint8_t* bytes, size_t size, const std::string& what);

// Writes atomically (temp file in the same folder, fsync, rename; see kiln/core/file.h).
// A tensor whose data size disagrees with its dtype and shape, a negative dimension or the
// reserved name "__metadata__" is Error(InvalidArgument); a file system failure Error(Io).
void write_safetensors(const std::string& path, const StFile& file);

// The exact bytes write_safetensors writes.
std::vector<uint8_t> serialize_safetensors(const StFile& file);

}  // namespace kiln
