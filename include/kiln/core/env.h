// Switches read from the environment. Every optimisation can be turned off this way
// (STYLE.md): KILN_FUSION, KILN_FUSE_POOL, KILN_MEMORY_REUSE, KILN_CUDA_GRAPHS, KILN_STREAMS,
// KILN_ENGINE_TABLE. A malformed value is an error, not a silent default.
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

// Returns fallback when the variable is unset; "0/1/true/false/on/off" otherwise.
bool env_flag(const char* name, bool fallback);
int64_t env_int(const char* name, int64_t fallback);
std::string env_string(const char* name, const std::string& fallback);

}  // namespace kiln
