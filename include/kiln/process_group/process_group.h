// The data-parallel process group: one process per device, started by mpirun or
// Slurm. Rank, world size and local rank come from the launcher's environment and are checked
// against MPI's own view; MPI starts only when the environment says there is more than one
// process (or when asked: `kiln train --distributed`), so a plain run never touches MPI.
//
// The collectives here are host-side and blocking: the CPU backend's allreduce / allgather
// kernels, metric reductions, start-up checks. The CUDA backend runs its own over NCCL on
// its streams; it gets the NCCL unique id through broadcast().
//
// Failure (no rank may wait forever for one that is gone):
//  - every collective runs under a watchdog: one that has not completed after
//    KILN_DIST_TIMEOUT seconds (default 600) — a peer died, hangs or lags far behind — makes
//    the process print which collective waited on which rank and exit with status 3; the
//    launcher then stops the others;
//  - MPI calls return their errors (MPI_ERRORS_RETURN) as kiln::Error(Backend);
//  - a process that leaves with an error (FailureGuard in scope when an exception passes,
//    or abort()) calls MPI_Abort, which stops every rank at once.
// A process that ends normally finalises MPI at exit (or when finalize() is called).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "kiln/core/dtype.h"
#include "kiln/core/switches.h"

namespace kiln::dist {

// What the launcher's environment says about this process.
struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0;
  bool local_known = false;  // the launcher named the local rank
  std::string source;        // the variables it came from, for messages; "" when none
};

// Reads, in this order (the first launcher found wins): Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK), MPICH / Intel MPI (PMI_RANK / PMI_SIZE,
// MPI_LOCALRANKID), Slurm's srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS,
// SLURM_LOCALID). Throws InvalidArgument naming the variables when they are malformed or
// disagree (a rank outside [0, world)). `get` is getenv, replaceable for tests.
LaunchEnv launch_env(const std::function<const char*(const char*)>& get);
LaunchEnv launch_env();

// Whether kiln was built with MPI (cmake found it); without it, world must be 1.
bool mpi_built();

// Starts the process group: MPI_Init when the environment says world > 1 or when `force`,
// then checks MPI's rank and size against the environment (an error naming the variables
// when they disagree). Idempotent; a later call with force = true after a plain start
// (world 1, no MPI) starts MPI then. `timeout_s`: how long a collective may wait before its
// process exits with status 3 (the edge passes Switches::dist_timeout).
void init(bool force = false, int64_t timeout_s = Switches{}.dist_timeout);
bool active();  // MPI is running (world may be 1 when forced)
int rank();     // 0 before init
int world();    // 1 before init
int local_rank();
inline bool is_root() {
  return rank() == 0;
}

// The per-rank batch: global / world; InvalidArgument when it does not divide.
int64_t split_batch(int64_t global_batch);

// Blocking collectives over every rank, watched by the watchdog. `what` names the data in
// messages ("grads deep", "evaluation metrics"). With world 1 they copy or do nothing.
enum class Reduce : uint8_t { sum, max, min };
void allreduce(void* data, int64_t count, DType dtype, Reduce op, const char* what);  // in place
void allreduce(double* data, int64_t count, Reduce op, const char* what);
void allreduce(uint64_t* data, int64_t count, Reduce op, const char* what);
// recv = [send of rank 0, ..., send of rank world-1]; count elements per rank.
void allgather(const void* send, void* recv, int64_t count, DType dtype, const char* what);
void broadcast(void* data, int64_t bytes, int root, const char* what);
void barrier(const char* what);

// Puts a blocking section under the watchdog (a training step whose collectives run on a
// device, where the host waits in a synchronisation rather than in MPI). No-op unless active.
class Watch {
 public:
  explicit Watch(const char* what);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  bool armed_ = false;
};

// Run by the watchdog about once a second while the group is active: a non-empty answer is
// an error that ends the process (the CUDA backend polls NCCL's asynchronous errors).
void add_health_check(std::function<std::string()> check);
// Run before MPI_Finalize / MPI_Abort, last added first (ncclCommDestroy / ncclCommAbort).
void add_finalizer(std::function<void(bool aborting)> fn);

// Normal end: finalizers, MPI_Finalize. Idempotent; also run at exit when no failure was noted.
void finalize();
// Prints "kiln: rank R of W: why" and stops every rank (MPI_Abort), or exits when not active.
[[noreturn]] void abort(int code, const std::string& why);
// Marks the process as failed: at exit it aborts the job instead of finalising.
void note_failure();

// In scope over a run: an exception leaving the scope notes a failure, so that the process,
// after main() printed the error, stops the other ranks instead of waiting in MPI_Finalize.
class FailureGuard {
 public:
  FailureGuard();
  ~FailureGuard();
  FailureGuard(const FailureGuard&) = delete;
  FailureGuard& operator=(const FailureGuard&) = delete;

 private:
  int exceptions_;
};

}  // namespace kiln::dist
