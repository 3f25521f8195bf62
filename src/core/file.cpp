#include "kiln/core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kiln/core/error.h"

namespace kiln {
namespace {

std::string errno_text(int err) {
  return std::strerror(err);
}

// Closes the descriptor on every way out of a scope unless it was released (fd = -1). A close
// error here is ignored: an exception is already on its way and is the one worth seeing.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  FdGuard f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KILN_CHECK(f.fd >= 0, Io, "cannot open '", path, "': ", errno_text(errno), "; check the path");
  struct stat st {};
  KILN_CHECK(::fstat(f.fd, &st) == 0, Io, "cannot stat '", path, "': ", errno_text(errno));
  KILN_CHECK(!S_ISDIR(st.st_mode), Io, "'", path, "' is a folder, not a file; check the path");
  std::vector<uint8_t> out;
  if (S_ISREG(st.st_mode)) out.reserve(static_cast<size_t>(st.st_size));
  uint8_t buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(f.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n >= 0, Io, "reading '", path, "' failed: ", errno_text(errno));
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  return out;
}

std::string read_file_text(const std::string& path) {
  const std::vector<uint8_t> bytes = read_file_bytes(path);
  return std::string(bytes.begin(), bytes.end());
}

std::string atomic_temp_path(const std::string& path) {
  return path + ".tmp." + std::to_string(::getpid());
}

void write_file_atomic(const std::string& path, std::span<const std::span<const uint8_t>> pieces) {
  const std::string tmp = atomic_temp_path(path);
  FdGuard f;
  // O_TRUNC rather than O_EXCL: a temp file with our name can only be left over from an
  // earlier process with the same pid that crashed, and it is ours to replace.
  f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  KILN_CHECK(f.fd >= 0, Io, "cannot write '", path, "': creating the temporary file '", tmp,
             "' failed: ", errno_text(errno), "; check that the folder exists and is writable");

  // From here on every failure removes the temporary file before throwing.
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(f.fd);
    f.fd = -1;
    ::unlink(tmp.c_str());
    KILN_FAIL(Io, "cannot write '", path, "': ", what, ": ", errno_text(err), "; the previous '",
              path, "' (if any) was left unchanged. Check free disk space, ",
              "quotas and file size limits");
  };

  size_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  size_t written = 0;
  for (const auto& piece : pieces) {
    const uint8_t* p = piece.data();
    size_t left = piece.size();
    while (left > 0) {
      const ssize_t n = ::write(f.fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(detail::concat("write failed after ", written, " of ", total, " bytes"));
      p += n;
      left -= static_cast<size_t>(n);
      written += static_cast<size_t>(n);
    }
  }
  // fsync before rename: otherwise a crash soon after can leave the new name pointing at a file
  // whose data never reached the disk (ext4 and xfs may order the rename first).
  if (::fsync(f.fd) != 0) fail("fsync failed");
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    KILN_FAIL(Io, "cannot write '", path, "': closing the temporary file failed: ", errno_text(err),
              "; the previous '", path, "' (if any) was left unchanged");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    KILN_FAIL(Io, "cannot write '", path, "': renaming '", tmp,
              "' over it failed: ", errno_text(err), "; the previous '", path,
              "' (if any) was left unchanged");
  }
  // Make the rename itself durable. Best effort: some file systems cannot fsync a folder, and
  // the new file is already complete either way.
  const int dir = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

void write_text_atomic(const std::string& path, std::string_view text) {
  const std::span<const uint8_t> piece(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  write_file_atomic(path, std::span<const std::span<const uint8_t>>(&piece, 1));
}

}  // namespace kiln
