// Rank, world size and local rank from the launcher's environment (see
// kiln/process_group/process_group.h). Kept apart from MPI so that it builds, and is tested,
// without it.
#include <cerrno>
#include <climits>
#include <cstdlib>

#include "kiln/core/error.h"
#include "kiln/process_group/process_group.h"

namespace kiln::dist {

namespace {

struct Launcher {
  const char* name;
  const char* rank;
  const char* size;
  const char* size_fallback;  // may be null
  const char* local;          // may be null
};

// mpirun inside a Slurm allocation sets both families; Open MPI's describe the ranks (the
// Slurm ones then describe mpirun's daemons), so it comes first.
constexpr Launcher kLaunchers[] = {
    {"mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", nullptr,
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", nullptr, "MPI_LOCALRANKID"},
    {"Slurm (srun)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID"},
};

int parse(const char* name, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  KILN_CHECK(*text != '\0' && end && *end == '\0' && errno == 0 && v >= 0 && v <= INT_MAX,
             InvalidArgument, "environment variable ", name, "='", text,
             "' is not a process count or index; it is set by ",
             "the launcher (mpirun, srun): unset it or start kiln through that launcher");
  return static_cast<int>(v);
}

}  // namespace

LaunchEnv launch_env(const std::function<const char*(const char*)>& get) {
  auto value = [&](const char* name) -> const char* {
    if (!name) return nullptr;
    const char* v = get(name);
    return (v && *v) ? v : nullptr;
  };
  LaunchEnv e;
  for (const Launcher& l : kLaunchers) {
    const char* rank = value(l.rank);
    const char* size_name = value(l.size) ? l.size : l.size_fallback;
    const char* size = value(size_name);
    if (!rank && !size) continue;
    KILN_CHECK(
        rank && size, InvalidArgument, "the environment of ", l.name,
        " is incomplete: ", rank ? l.rank : l.size, " is set but ", rank ? l.size : l.rank,
        " is not; start kiln through the launcher itself (mpirun -np N kiln ..., srun kiln ...)");
    e.rank = parse(l.rank, rank);
    e.world = parse(size_name, size);
    e.source = std::string(l.rank) + "=" + rank + ", " + size_name + "=" + size;
    KILN_CHECK(e.world >= 1 && e.rank < e.world, InvalidArgument,
               "the launcher's environment disagrees with itself: ", e.source, " (", l.name,
               "): the rank must lie in [0, size)");
    if (const char* local = value(l.local)) {
      e.local_rank = parse(l.local, local);
      e.local_known = true;
      e.source += std::string(", ") + l.local + "=" + local;
      KILN_CHECK(e.local_rank < e.world, InvalidArgument,
                 "the launcher's environment disagrees with itself: ", e.source,
                 ": the local rank must be below the number of processes");
    }
    return e;
  }
  return e;
}

LaunchEnv launch_env() {
  return launch_env([](const char* name) { return static_cast<const char*>(std::getenv(name)); });
}

int64_t split_batch(int64_t global_batch) {
  const int w = world();
  KILN_CHECK(global_batch > 0 && global_batch % w == 0, InvalidArgument, "--batch-size ",
             global_batch, " is the global batch and must split evenly over the ", w,
             " processes (each takes batch / ", w, "); use a multiple of ", w);
  return global_batch / w;
}

}  // namespace kiln::dist
