// libFuzzer target for the safetensors reader. Properties checked on every input:
//  - the only thing parse_safetensors may throw is Error(Checkpoint) (anything else escapes and
//    libFuzzer reports it; ASan catches reads past the buffer);
//  - whatever it accepts survives serialize -> parse unchanged, and serializing that again
//    gives the same bytes (kiln's writer is a fixed point of its reader).
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/io/safetensors.h"

namespace {

bool same(const kiln::StFile& a, const kiln::StFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, t] : a.tensors) {
    const auto it = b.tensors.find(name);
    if (it == b.tensors.end()) return false;
    if (t.dtype != it->second.dtype || t.shape != it->second.shape || t.data != it->second.data) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::StFile file;
  try {
    file = kiln::parse_safetensors(data, size, "fuzz-input");
  } catch (const kiln::Error& e) {
    if (e.kind() != kiln::ErrorKind::Checkpoint) std::abort();
    return 0;
  }
  const std::vector<uint8_t> bytes = kiln::serialize_safetensors(file);
  const kiln::StFile again = kiln::parse_safetensors(bytes.data(), bytes.size(), "round-trip");
  if (!same(file, again)) std::abort();
  if (kiln::serialize_safetensors(again) != bytes) std::abort();
  return 0;
}
