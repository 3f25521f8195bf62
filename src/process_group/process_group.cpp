// The process group over MPI, its watchdog and its exit paths (see
// kiln/process_group/process_group.h). Built without MPI (cmake did not find it), it runs one
// process and refuses more.
#include "kiln/process_group/process_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/log.h"

#if defined(KILN_HAVE_MPI)
#include <mpi.h>
#endif

namespace kiln::dist {

namespace {

using Clock = std::chrono::steady_clock;

struct WatchEntry {
  uint64_t id;
  std::string what;
  Clock::time_point start;
};

struct State {
  std::mutex mu;          // init / finalize / the lists below
  bool mpi = false;       // MPI is running and kiln uses it
  bool owns_mpi = false;  // kiln called MPI_Init (so it calls MPI_Finalize)
  bool finalized = false;
  bool exit_hook = false;
  std::atomic<bool> failed{false};
  int rank = 0, world = 1, local_rank = 0;
  int timeout_s = 600;
#if defined(KILN_HAVE_MPI)
  MPI_Comm comm = MPI_COMM_NULL;
#endif
  // Watchdog.
  std::thread watchdog;
  std::condition_variable cv;
  bool stop = false;
  std::vector<WatchEntry> watches;
  uint64_t next_watch = 1;
  std::vector<std::function<std::string()>> health;
  std::vector<std::function<void(bool)>> finalizers;
};

// Never destroyed: the exit hook and the watchdog may use it while statics are torn down.
State& st() {
  static State* s = new State;
  return *s;
}

[[noreturn]] void die(int code, const std::string& why) {
  State& s = st();
  std::fprintf(stderr, "kiln: rank %d of %d: %s\n", s.rank, s.world, why.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(code);
}

void run_finalizers(bool aborting) {
  State& s = st();
  std::vector<std::function<void(bool)>> fns;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    fns.swap(s.finalizers);
  }
  for (auto it = fns.rbegin(); it != fns.rend(); ++it) {
    try {
      (*it)(aborting);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kiln: rank %d: while shutting down: %s\n", s.rank, e.what());
    }
  }
}

void watchdog_loop() {
  State& s = st();
  std::unique_lock<std::mutex> lock(s.mu);
  auto last_health = Clock::now();
  while (!s.stop) {
    s.cv.wait_for(lock, std::chrono::milliseconds(200));
    if (s.stop) break;
    const auto now = Clock::now();
    const auto limit = std::chrono::seconds(s.timeout_s);
    for (const WatchEntry& w : s.watches) {
      if (now - w.start < limit) continue;
      // The innermost section that is late says the most (a collective inside a step).
      const WatchEntry& late = s.watches.back();
      const auto waited =
          std::chrono::duration_cast<std::chrono::seconds>(now - late.start).count();
      const std::string why =
          "'" + late.what + "' has waited " + std::to_string(waited) +
          " s for the other ranks (KILN_DIST_TIMEOUT=" + std::to_string(s.timeout_s) +
          "): another rank has died, hangs or is far behind; stopping this one "
          "so that the launcher stops the rest";
      lock.unlock();
      die(3, why);
    }
    if (now - last_health >= std::chrono::seconds(1)) {
      last_health = now;
      const auto checks = s.health;
      lock.unlock();
      for (const auto& check : checks) {
        std::string err;
        try {
          err = check();
        } catch (const std::exception& e) {
          err = e.what();
        }
        if (!err.empty()) {
          run_finalizers(/*aborting=*/true);
          die(3, err);
        }
      }
      lock.lock();
    }
  }
}

void stop_watchdog() {
  State& s = st();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stop = true;
  }
  s.cv.notify_all();
  if (s.watchdog.joinable() && s.watchdog.get_id() != std::this_thread::get_id()) s.watchdog.join();
}

void finalize_impl(bool run_fns);
[[noreturn]] void abort_impl(int code, const std::string& why, bool run_fns);

// At exit, after main() returned or exit() was called. The finalizers do not run here: the
// CUDA runtime may already be torn down (its own exit hook ran first), and the process ends
// anyway. A noted failure stops every rank; otherwise MPI ends normally.
void exit_hook() {
  State& s = st();
  if (!s.mpi || s.finalized) return;
  if (s.failed.load())
    abort_impl(2, "exiting on the error above; stopping every rank", /*run_fns=*/false);
  try {
    finalize_impl(/*run_fns=*/false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln: rank %d: %s\n", s.rank, e.what());
  }
}

#if defined(KILN_HAVE_MPI)
void check_mpi(int rc, const char* call, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
    len = std::snprintf(msg, sizeof msg, "error %d", rc);
  note_failure();
  KILN_FAIL(Backend, call, " for '", what, "' failed on rank ", st().rank, " of ", st().world, ": ",
            std::string(msg, static_cast<size_t>(len)),
            "; another rank has probably died (see its output)");
}

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::U8:
      return MPI_UINT8_T;
    default:
      KILN_FAIL(Unsupported, "MPI collectives take f32, i32, i64 or u8 data, not ", dtype_name(d),
                "; cast to f32 first");
  }
}

MPI_Op mpi_op(Reduce op) {
  switch (op) {
    case Reduce::sum:
      return MPI_SUM;
    case Reduce::max:
      return MPI_MAX;
    case Reduce::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

// MPI counts are int: large buffers go in pieces.
constexpr int64_t kChunk = int64_t{1} << 30;

void allreduce_raw(void* data, int64_t count, MPI_Datatype type, size_t elem, Reduce op,
                   const char* what) {
  if (st().world == 1 || count == 0) return;
  Watch watch(what);
  auto* p = static_cast<uint8_t*>(data);
  for (int64_t off = 0; off < count; off += kChunk) {
    const int n = static_cast<int>(std::min(kChunk, count - off));
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, p + static_cast<size_t>(off) * elem, n, type, mpi_op(op),
                            st().comm),
              "MPI_Allreduce", what);
  }
}
#endif

}  // namespace

bool mpi_built() {
#if defined(KILN_HAVE_MPI)
  return true;
#else
  return false;
#endif
}

bool active() {
  return st().mpi;
}
int rank() {
  return st().rank;
}
int world() {
  return st().world;
}
int local_rank() {
  return st().local_rank;
}

void init(bool force, int64_t timeout_s) {
  State& s = st();
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.mpi) return;
  const LaunchEnv env = launch_env();
  if (env.world <= 1 && !force) return;  // one process: no MPI at all
#if !defined(KILN_HAVE_MPI)
  (void)timeout_s;
  KILN_FAIL(Unsupported, "this kiln was built without MPI, but ",
            env.source.empty() ? std::string("--distributed") : env.source, " asks for ", env.world,
            " processes; install an MPI (Debian: libopenmpi-dev openmpi-bin, as scripts/setup.sh "
            "does) and rebuild, or run a single process");
#else
  KILN_CHECK(!s.finalized, State,
             "the process group was already finalised; MPI cannot start twice in one process");
  s.timeout_s = static_cast<int>(timeout_s);
  KILN_CHECK(s.timeout_s > 0, InvalidArgument,
             "KILN_DIST_TIMEOUT must be a number of seconds > 0, is ", s.timeout_s);
  s.rank = env.rank;
  s.world = std::max(env.world, 1);
  // The watchdog guards MPI_Init too: a rank that never starts must not hold the others.
  s.stop = false;
  s.watches.push_back({s.next_watch++, "MPI_Init", Clock::now()});
  s.watchdog = std::thread(watchdog_loop);
  lock.unlock();
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    int provided = 0;
    // FUNNELED: only the trainer's thread calls MPI (loader threads never do).
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    KILN_CHECK(rc == MPI_SUCCESS, Backend, "MPI_Init failed (", rc, ") with ",
               env.source.empty() ? "no launcher variables" : env.source,
               "; start kiln with mpirun -np N or srun");
  }
  lock.lock();
  s.watches.clear();
  s.mpi = true;
  s.owns_mpi = !initialised;
  if (!s.exit_hook) {
    std::atexit(exit_hook);
    s.exit_hook = true;
  }
  lock.unlock();
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &s.comm), "MPI_Comm_dup", "kiln's communicator");
  MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN);
  int r = 0, w = 1;
  MPI_Comm_rank(s.comm, &r);
  MPI_Comm_size(s.comm, &w);
  if (!env.source.empty() && (r != env.rank || w != env.world)) {
    note_failure();
    KILN_FAIL(
        InvalidArgument, "the launcher's environment (", env.source, ") says rank ", env.rank,
        " of ", env.world, " but MPI started rank ", r, " of ", w,
        ": kiln was not started by the launcher that set those variables (in a Slurm batch "
        "script, start it with srun; with Open MPI, with mpirun -np N), or the MPI kiln was built "
        "with is not the launcher's (srun --mpi=pmix needs an MPI with PMIx)");
  }
  s.rank = r;
  s.world = w;
  MPI_Comm local = MPI_COMM_NULL;
  int lr = 0;
  check_mpi(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &local),
            "MPI_Comm_split_type", "node-local ranks");
  MPI_Comm_rank(local, &lr);
  MPI_Comm_free(&local);
  if (env.local_known && env.local_rank != lr) {
    log_warn("rank ", r, ": the launcher says local rank ", env.local_rank, " (", env.source,
             ") but MPI counts ", lr, " on this node; using the launcher's");
    lr = env.local_rank;
  }
  s.local_rank = lr;
  log_info("process group: rank ", r, " of ", w, ", local rank ", lr,
           env.source.empty() ? std::string(" (no launcher variables)") : " (" + env.source + ")",
           ", watchdog ", s.timeout_s, " s");
#endif
}

void allreduce(void* data, int64_t count, DType dtype, Reduce op, const char* what) {
#if defined(KILN_HAVE_MPI)
  if (st().world == 1) return;
  allreduce_raw(data, count, mpi_type(dtype), dtype_size(dtype), op, what);
#else
  (void)data, (void)count, (void)dtype, (void)op, (void)what;
#endif
}

void allreduce(double* data, int64_t count, Reduce op, const char* what) {
#if defined(KILN_HAVE_MPI)
  allreduce_raw(data, count, MPI_DOUBLE, sizeof(double), op, what);
#else
  (void)data, (void)count, (void)op, (void)what;
#endif
}

void allreduce(uint64_t* data, int64_t count, Reduce op, const char* what) {
#if defined(KILN_HAVE_MPI)
  allreduce_raw(data, count, MPI_UINT64_T, sizeof(uint64_t), op, what);
#else
  (void)data, (void)count, (void)op, (void)what;
#endif
}

void allgather(const void* send, void* recv, int64_t count, DType dtype, const char* what) {
  const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
  if (st().world == 1) {
    if (send != recv && bytes > 0) std::memmove(recv, send, bytes);
    return;
  }
#if defined(KILN_HAVE_MPI)
  KILN_CHECK(count <= kChunk, Unsupported, "allgather of '", what, "': ", count,
             " elements per rank is more than MPI takes in one call");
  Watch watch(what);
  const int n = static_cast<int>(count);
  check_mpi(MPI_Allgather(send, n, mpi_type(dtype), recv, n, mpi_type(dtype), st().comm),
            "MPI_Allgather", what);
#endif
}

void broadcast(void* data, int64_t bytes, int root, const char* what) {
#if defined(KILN_HAVE_MPI)
  if (st().world == 1 || bytes == 0) return;
  Watch watch(what);
  auto* p = static_cast<uint8_t*>(data);
  for (int64_t off = 0; off < bytes; off += kChunk) {
    const int n = static_cast<int>(std::min(kChunk, bytes - off));
    check_mpi(MPI_Bcast(p + off, n, MPI_BYTE, root, st().comm), "MPI_Bcast", what);
  }
#else
  (void)data, (void)bytes, (void)root, (void)what;
#endif
}

void barrier(const char* what) {
#if defined(KILN_HAVE_MPI)
  if (st().world == 1) return;
  Watch watch(what);
  check_mpi(MPI_Barrier(st().comm), "MPI_Barrier", what);
#else
  (void)what;
#endif
}

Watch::Watch(const char* what) {
  State& s = st();
  if (!s.mpi) return;
  std::lock_guard<std::mutex> lock(s.mu);
  s.watches.push_back({s.next_watch++, what, Clock::now()});
  armed_ = true;
}

Watch::~Watch() {
  if (!armed_) return;
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.watches.empty()) s.watches.pop_back();
}

void add_health_check(std::function<std::string()> check) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  s.health.push_back(std::move(check));
}

void add_finalizer(std::function<void(bool)> fn) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  s.finalizers.push_back(std::move(fn));
}

namespace {

void finalize_impl(bool run_fns) {
  State& s = st();
  if (!s.mpi || s.finalized) return;
#if defined(KILN_HAVE_MPI)
  // Every rank reaches the end before MPI_Finalize, under the watchdog: MPI_Finalize waits for
  // the others and would hang, unwatched, on a rank that is gone.
  barrier("the end of the run");
  stop_watchdog();
  if (run_fns) run_finalizers(/*aborting=*/false);
  MPI_Comm_free(&s.comm);
  s.finalized = true;
  s.mpi = false;
  if (s.owns_mpi) MPI_Finalize();
#else
  (void)run_fns;
#endif
}

void abort_impl(int code, const std::string& why, bool run_fns) {
  State& s = st();
  std::fprintf(stderr, "kiln: rank %d of %d: %s\n", s.rank, s.world, why.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
#if defined(KILN_HAVE_MPI)
  if (s.mpi && !s.finalized) {
    if (run_fns) run_finalizers(/*aborting=*/true);
    MPI_Abort(MPI_COMM_WORLD, code);
  }
#else
  (void)run_fns;
#endif
  std::_Exit(code);
}

}  // namespace

void finalize() {
  finalize_impl(/*run_fns=*/true);
}

void abort(int code, const std::string& why) {
  abort_impl(code, why, /*run_fns=*/true);
}

void note_failure() {
  st().failed = true;
}

FailureGuard::FailureGuard() : exceptions_(std::uncaught_exceptions()) {}
FailureGuard::~FailureGuard() {
  if (std::uncaught_exceptions() > exceptions_) note_failure();
}

}  // namespace kiln::dist
