#include "data/file_bytes.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "kiln/core/error.h"

namespace kiln::data_detail {

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  // fopen() opens a directory too, and ftell() then reports 2^63-1 bytes: the reserve below
  // would throw std::bad_alloc with no path.
  std::error_code ec;
  KILN_CHECK(!std::filesystem::is_directory(path, ec), Data, "data file '", path,
             "' is a directory, not a file; point --data at the directory that holds the files, "
             "or give the file's own path");
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  KILN_CHECK(f != nullptr, Data, "cannot open data file '", path, "': ", std::strerror(errno),
             "; check the path (and --data) or download the dataset");
  std::vector<uint8_t> bytes;
  if (std::fseek(f.get(), 0, SEEK_END) == 0) {
    const long end = std::ftell(f.get());
    if (end > 0 && end < (long{1} << 34)) bytes.reserve(static_cast<size_t>(end));
    std::fseek(f.get(), 0, SEEK_SET);
  }
  // Read in chunks rather than trusting ftell, so pipes and files that change size still work.
  uint8_t chunk[1 << 16];
  size_t n = 0;
  while ((n = std::fread(chunk, 1, sizeof chunk, f.get())) > 0) {
    bytes.insert(bytes.end(), chunk, chunk + n);
  }
  KILN_CHECK(!std::ferror(f.get()), Data, "error while reading data file '", path,
             "': ", std::strerror(errno), "; check the disk and the file");
  return bytes;
}

bool is_gzip(const uint8_t* bytes, size_t size) {
  return size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

std::vector<uint8_t> gunzip(const uint8_t* bytes, size_t size, const std::string& what,
                            size_t max_output) {
  z_stream zs{};
  // 15 + 16: gzip wrapper only (a zlib stream with a gzip magic would be a different mistake).
  KILN_CHECK(inflateInit2(&zs, 15 + 16) == Z_OK, Internal, "zlib inflateInit2 failed");
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, &inflateEnd);

  // Size the output from the gzip trailer (ISIZE: the last member's length mod 2^32), +1 so that
  // reading the trailer needs no second buffer. It is a hint only: never beyond max_output,
  // nor beyond what deflate's best ratio (about 1032:1) could give, so a forged trailer cannot
  // make us allocate gigabytes up front.
  size_t hint = size >= 18 ? (size_t{bytes[size - 4]} | size_t{bytes[size - 3]} << 8 |
                              size_t{bytes[size - 2]} << 16 | size_t{bytes[size - 1]} << 24)
                           : 0;
  hint = std::min({hint + 1, max_output, size * 1032 + (1 << 16)});
  std::vector<uint8_t> out(std::min(max_output, std::max<size_t>(hint, 1 << 12)));
  size_t produced = 0;
  zs.next_in = const_cast<Bytef*>(bytes);
  size_t input_left = size;
  for (;;) {
    if (produced == out.size()) {
      KILN_CHECK(out.size() < max_output, Data, "'", what, "': gzip data inflates past ",
                 max_output,
                 " bytes, more than any dataset file kiln reads; the file is not "
                 "what it claims to be, download it again");
      out.resize(std::min(max_output, out.size() * 2));
      // (A vector that grew past its final size keeps the capacity; callers copy what they keep.)
    }
    // zlib counts in uInt; feed at most 1 GiB at a time so huge files work.
    const uInt in_chunk = static_cast<uInt>(std::min<size_t>(input_left, 1u << 30));
    const uInt out_chunk = static_cast<uInt>(std::min<size_t>(out.size() - produced, 1u << 30));
    zs.avail_in = in_chunk;
    zs.next_out = out.data() + produced;
    zs.avail_out = out_chunk;
    const int rc = inflate(&zs, Z_NO_FLUSH);
    input_left -= in_chunk - zs.avail_in;
    produced += out_chunk - zs.avail_out;
    if (rc == Z_STREAM_END) {
      // Another gzip member may follow (gzip -c a b > c); anything else after it is garbage.
      if (input_left == 0) break;
      KILN_CHECK(is_gzip(zs.next_in, input_left), Data, "'", what, "': ", input_left,
                 " bytes of garbage after the end of the gzip stream; download the file again");
      KILN_CHECK(inflateReset(&zs) == Z_OK, Internal, "zlib inflateReset failed");
      continue;
    }
    KILN_CHECK(rc == Z_OK || rc == Z_BUF_ERROR, Data, "'", what,
               "': corrupt gzip data (zlib: ", zs.msg ? zs.msg : "error ",
               zs.msg ? "" : std::to_string(rc), "); download the file again");
    if (rc == Z_BUF_ERROR || (input_left == 0 && zs.avail_out != 0)) {
      // No progress possible: the input ended before the stream did.
      KILN_CHECK(!(input_left == 0), Data, "'", what, "': the gzip stream is truncated (", size,
                 " bytes read, it ends early); the download was probably interrupted, download "
                 "it again");
    }
  }
  out.resize(produced);
  return out;
}

}  // namespace kiln::data_detail
