// Rank, world and local rank from the launcher's variables (kiln::dist::launch_env), and the
// per-rank batch: Open MPI's mpirun, Slurm's srun, both at once (mpirun inside an
// allocation), none, and variables that disagree — a clear error naming them.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "kiln/core/error.h"
#include "kiln/process_group/process_group.h"

namespace kiln {
namespace {

dist::LaunchEnv env_of(const std::map<std::string, std::string>& vars) {
  return dist::launch_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    env_of(vars);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  const dist::LaunchEnv e = env_of({});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world, 1);
  EXPECT_TRUE(e.source.empty());
}

TEST(LaunchEnv, OpenMpi) {
  const dist::LaunchEnv e = env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                    {"OMPI_COMM_WORLD_SIZE", "8"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_TRUE(e.local_known);
}

TEST(LaunchEnv, SlurmPrefersTheStepsTaskCount) {
  dist::LaunchEnv e =
      env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 16);
  EXPECT_EQ(e.local_rank, 1);
  e = env_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "16"}, {"SLURM_STEP_NUM_TASKS", "4"}});
  EXPECT_EQ(e.world, 4);
  EXPECT_FALSE(e.local_known);
}

// mpirun inside a Slurm allocation: the Slurm variables describe mpirun's daemons.
TEST(LaunchEnv, OpenMpiWinsOverSlurm) {
  const dist::LaunchEnv e = env_of({{"SLURM_PROCID", "0"},
                                    {"SLURM_NTASKS", "2"},
                                    {"OMPI_COMM_WORLD_RANK", "6"},
                                    {"OMPI_COMM_WORLD_SIZE", "8"}});
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world, 8);
}

TEST(LaunchEnv, DisagreeingVariablesNameThemselves) {
  std::string m = error_of({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_NE(m.find("OMPI_COMM_WORLD_RANK=4"), std::string::npos) << m;
  EXPECT_NE(m.find("OMPI_COMM_WORLD_SIZE=4"), std::string::npos) << m;
  m = error_of({{"SLURM_PROCID", "0"}});
  EXPECT_NE(m.find("SLURM_PROCID"), std::string::npos) << m;
  EXPECT_NE(m.find("SLURM_STEP_NUM_TASKS"), std::string::npos) << m;
  m = error_of({{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}});
  EXPECT_NE(m.find("PMI_RANK='x'"), std::string::npos) << m;
  m = error_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "7"}});
  EXPECT_NE(m.find("SLURM_LOCALID=7"), std::string::npos) << m;
}

TEST(LaunchEnv, TheGlobalBatchSplitsEvenly) {
  const int w = dist::world();
  EXPECT_EQ(dist::split_batch(8 * w), 8);
  if (w > 1) {
    try {
      dist::split_batch(8 * w + 1);
      ADD_FAILURE() << "an uneven batch split";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of " + std::to_string(w)), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace kiln
