#include "task/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/file.h"
#include "kiln/core/log.h"

namespace kiln {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, sig)) return;
  if (sig == SIGINT) {
    static const char kMsg[] =
        "\nkiln: second interrupt: stopping now; the last checkpoint written is kept\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    ::_exit(128 + SIGINT);
  }
}

struct sigaction g_previous[3];

// A positive decimal PID, or 0.
long parse_pid(const std::string& s) {
  if (s.empty() || s.size() > 10 || s.find_first_not_of("0123456789") != std::string::npos)
    return 0;
  return std::stol(s);
}

}  // namespace

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
  }
  return "a signal";
}

RunFolderLock::RunFolderLock(const std::string& folder) : path_(folder + "/.lock") {
  // The file is removed on release, so a process may lock a name that a newer one replaced:
  // it checks that the path still names the file it locked, else it tries again.
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    KILN_CHECK(fd >= 0, Io, "cannot open the lock file '", path_, "': ", std::strerror(errno),
               "; check that the output folder '", folder, "' is writable");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[32] = {};
      const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      ::close(fd);
      KILN_CHECK(err == EWOULDBLOCK, Io, "cannot lock '", path_, "': ", std::strerror(err));
      std::string pid = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
      while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
      KILN_FAIL(
          State, "the output folder '", folder, "' is in use by another kiln train (PID ",
          pid.empty() ? "unknown" : pid, ", which holds '", path_,
          "'); two runs in one folder would mix their metrics and checkpoints. Wait for it to end, "
          "stop it, or give another --output");
    }
    struct stat by_fd {
    }, by_path{};
    if (::fstat(fd, &by_fd) == 0 && ::stat(path_.c_str(), &by_path) == 0 &&
        by_fd.st_ino == by_path.st_ino && by_fd.st_dev == by_path.st_dev) {
      fd_ = fd;
      break;
    }
    ::close(fd);
    KILN_CHECK(attempt < 100, Io, "cannot lock '", path_, "': the file keeps being replaced");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    log_warn("could not write the PID into '", path_, "': ", std::strerror(errno));
  }
}

RunFolderLock::~RunFolderLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // before the unlock: a waiting process then sees the name gone
  ::close(fd_);
}

std::vector<std::string> remove_stale_temp_files(const std::string& folder) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.rfind(".tmp.");
    if (at == std::string::npos || at == 0) continue;
    const long pid = parse_pid(name.substr(at + 5));
    if (pid <= 0 || pid == ::getpid()) continue;
    // A process that exists (even one we may not signal) may still be writing its file.
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    if (fs::remove(it->path(), rm)) removed.push_back(name);
  }
  return removed;
}

StopSignals::StopSignals() {
  g_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // the loop's reads and writes carry on; it checks the flag itself
  for (int i = 0; i < 3; ++i) ::sigaction(kStopSignals[i], &sa, &g_previous[i]);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
}

int StopSignals::pending() {
  return g_signal.load();
}

// The device state is read once (last.safetensors); best and epoch-N are copies of its bytes.
void keep_epoch_copies(const std::string& last, int64_t epoch, bool best, int64_t keep_last) {
  if (!best && keep_last == 0) return;
  const std::vector<uint8_t> bytes = read_file_bytes(last);
  const std::span<const uint8_t> piece(bytes);
  const std::filesystem::path dir = std::filesystem::path(last).parent_path();
  if (best) write_file_atomic((dir / "best.safetensors").string(), {&piece, 1});
  if (keep_last == 0) return;
  write_file_atomic((dir / ("epoch-" + std::to_string(epoch) + ".safetensors")).string(),
                    {&piece, 1});
  const std::string head = "epoch-", ext = ".safetensors";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    // Only epoch-<digits>.safetensors; temporary files and anything else stay.
    const std::string name = e.path().filename().string();
    if (name.size() <= head.size() + ext.size() || name.rfind(head, 0) != 0 ||
        name.compare(name.size() - ext.size(), ext.size(), ext) != 0) {
      continue;
    }
    const std::string digits = name.substr(head.size(), name.size() - head.size() - ext.size());
    if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (std::stoll(digits) <= epoch - keep_last) std::filesystem::remove(e.path(), ec);
  }
}

}  // namespace kiln
