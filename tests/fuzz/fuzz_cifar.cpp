// libFuzzer target for the CIFAR-10/100 record parser. Each input is parsed both ways (one and
// two label bytes). Properties: the only thing parse_cifar may throw is Error(Data); accepted
// input is a whole number of records with labels in range; the HWC pixels equal the CHW input
// bytes moved (checked here independently for the first and last record); CifarDataset hands
// out the same bytes.
#include <cstdint>
#include <cstdlib>

#include "kiln/core/error.h"
#include "kiln/data/cifar.h"

namespace {

void check(const uint8_t* data, size_t size, int label_bytes, int classes) {
  kiln::CifarRecords r;
  try {
    r = kiln::parse_cifar(data, size, label_bytes, classes, "fuzz-input");
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Data) std::abort();
    return;
  }
  const size_t record = static_cast<size_t>(label_bytes + kiln::kCifarPixels);
  if (r.count <= 0 || static_cast<size_t>(r.count) * record != size) std::abort();
  if (r.labels.size() != static_cast<size_t>(r.count)) std::abort();
  if (r.hwc.size() != static_cast<size_t>(r.count * kiln::kCifarPixels)) std::abort();
  kiln::CifarDataset ds(r, classes, "fuzz");
  for (int64_t i : {int64_t{0}, r.count - 1}) {
    const uint8_t* rec = data + static_cast<size_t>(i) * record;
    const kiln::Sample s = ds.sample(i);
    if (s.label != rec[label_bytes - 1] || s.label >= classes) std::abort();
    for (int c = 0; c < 3; ++c) {
      for (int p = 0; p < 1024; p += 37) {  // a spread of pixels, every channel
        if (s.image.pixels[static_cast<size_t>(3 * p + c)] != rec[label_bytes + 1024 * c + p]) {
          std::abort();
        }
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check(data, size, 1, 10);
  check(data, size, 2, 100);
  return 0;
}
