// Sets an environment variable for the lifetime of the object (the optimisation switches:
// KILN_CUDA_GRAPHS, KILN_STREAMS, KILN_FUSE_GRAD_SUM...), restoring what was there before.
#pragma once
#include <cstdlib>
#include <string>

namespace kiln::test {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// Unsets an environment variable for the object's lifetime, restoring what was there.
class ScopedUnset {
 public:
  explicit ScopedUnset(const char* name) : name_(name) {
    if (const char* old = std::getenv(name)) {
      had_ = true;
      old_ = old;
    }
    unsetenv(name);
  }
  ~ScopedUnset() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
  }
  ScopedUnset(const ScopedUnset&) = delete;
  ScopedUnset& operator=(const ScopedUnset&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace kiln::test
