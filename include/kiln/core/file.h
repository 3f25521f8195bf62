// Whole-file reads and atomic writes. Nothing kiln writes is ever left half-written
// (ARCHITECTURE "Errors"): a file is written to `<path>.tmp.<pid>` in the same folder, fsynced and
// renamed over `<path>`, so a reader sees the old file or the new one, never a mix, and a
// crash or a full disk leaves the old file as it was.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// The whole file. Throws Error(Io) naming the path and the system's reason.
std::vector<uint8_t> read_file_bytes(const std::string& path);
std::string read_file_text(const std::string& path);

// Writes the concatenation of `pieces` to `path` atomically (see above). On any failure the
// temporary file is removed, `path` is untouched, and Error(Io) says what failed and why.
// Two threads of one process must not write the same path at once (they share the temp name).
void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces);
void write_text_atomic(const std::string& path, std::string_view text);

// The temporary name write_file_atomic uses for `path` in this process.
std::string atomic_temp_path(const std::string& path);

}  // namespace kiln
