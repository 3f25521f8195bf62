// libFuzzer target for the IDX reader (plain and gzip). Properties checked on every input:
//  - the only thing parse_idx may throw is Error(Data) (anything else escapes and libFuzzer
//    reports it; ASan and UBSan catch bad reads and overflow);
//  - an accepted array has 1..4 dimensions and exactly product(dims) bytes;
//  - an accepted image array (3 or 4 dimensions) builds an IdxDataset, or is refused with
//    Error(Data), and its first and last samples are the right bytes of the array;
//  - every sample's shape is the header's (H x W, and C for 4 dimensions), so a batch buffer
//    sized from the dataset's shape holds each sample exactly (issue 15's overflow came from a
//    split whose shape differed from the buffer's).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/data/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::IdxArray a;
  try {
    a = kiln::parse_idx(data, size, "fuzz-input");
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Data) std::abort();
    return 0;
  }
  if (a.dims.empty() || a.dims.size() > 4) std::abort();
  uint64_t total = 1;
  for (int64_t d : a.dims) total *= static_cast<uint64_t>(d);
  if (a.data.size() != total) std::abort();
  // Only arrays with pixels: a header like 4e9 x 0 x 2 is valid IDX with no data, and a label
  // array of 4e9 entries made here would only exhaust the fuzzer's memory.
  if (a.dims.size() < 3 || a.data.empty()) return 0;

  kiln::IdxArray labels;
  labels.dims = {a.dims[0]};
  labels.data.assign(static_cast<size_t>(a.dims[0]), 3);
  const std::vector<uint8_t> pixels = a.data;
  const int64_t want_h = a.dims[1], want_w = a.dims[2], want_c = a.dims.size() == 4 ? a.dims[3] : 1;
  try {
    kiln::IdxDataset ds(std::move(a), std::move(labels), "images", "labels", "fuzz");
    const size_t per = pixels.size() / static_cast<size_t>(ds.size());
    for (int64_t i : {int64_t{0}, ds.size() - 1}) {
      const kiln::Sample s = ds.sample(i);
      if (s.label != 3 || s.image.pixels.size() != per) std::abort();
      if (s.image.height != want_h || s.image.width != want_w || s.image.channels != want_c)
        std::abort();
      if (static_cast<size_t>(s.image.numel()) != per) std::abort();
      if (std::memcmp(s.image.pixels.data(), pixels.data() + per * static_cast<size_t>(i), per) !=
          0) {
        std::abort();
      }
    }
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Data) std::abort();
  }
  return 0;
}
