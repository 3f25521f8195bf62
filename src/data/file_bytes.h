// Whole-file reads for the data module, and gzip inflation in memory (so that the parsers, and
// their fuzzers, work on buffers and never need the file system).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::data_detail {

// The file's bytes; Error(Data) naming the path when it is missing or unreadable (a data file
// that is not there is a data problem for the user, with the same fix as a truncated one).
std::vector<uint8_t> read_file_bytes(const std::string& path);

bool is_gzip(const uint8_t* bytes, size_t size);

// Inflates a whole gzip stream (concatenated members included). A corrupt or truncated stream,
// or one that inflates past max_output bytes, is Error(Data) naming `what`.
std::vector<uint8_t> gunzip(const uint8_t* bytes, size_t size, const std::string& what,
                            size_t max_output);

}  // namespace kiln::data_detail
