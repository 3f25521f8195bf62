// A training run's hold on its output folder: one run per folder (an flock'd `.lock` holding
// the PID), the temporary files of runs that died removed at start, and the stop signals
// (SIGINT, SIGTERM, SIGHUP) turned into a flag that the training loop reads between steps, and
// the copies of an epoch's checkpoint kept beside last.safetensors (best, --keep-last).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

// Held for the run's duration. A folder locked by a live process is Error(State) naming that
// process's PID and the folder; the lock of a killed run is released by the kernel.
class RunFolderLock {
 public:
  explicit RunFolderLock(const std::string& folder);
  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

// Removes `<name>.tmp.<pid>` files (write_file_atomic's) whose process no longer exists;
// returns the names removed.
std::vector<std::string> remove_stale_temp_files(const std::string& folder);

// After an epoch's checkpoint `last` (last.safetensors): copies it to best.safetensors when
// `best` (the epoch's test top-1 is the run's best), and to epoch-<epoch>.safetensors when
// keep_last > 0, removing the epoch-N files of epochs <= epoch - keep_last. Atomic writes.
void keep_epoch_copies(const std::string& last, int64_t epoch, bool best, int64_t keep_last);

// Installs the handlers for its lifetime and restores the previous ones after. The handlers
// only record the signal; a second SIGINT ends the process at once (exit 130), for a user
// who will not wait for the step and the checkpoint.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  static int pending();  // the first signal received (SIGINT, SIGTERM or SIGHUP), 0 if none
};

const char* signal_name(int signal);

}  // namespace kiln
