// Errors: one typed exception for everything kiln rejects, and the check macros.
// Every message names the thing that is wrong and says how to fix it.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kiln {

enum class ErrorKind {
  InvalidArgument,  // a flag, an option, an API argument
  Model,            // a malformed BluePrint or an unknown model name
  Shape,            // shape inference failed (kernel larger than input, zero channels)
  Memory,           // a region/dtype/alignment rule of the MemoryPlan was broken
  State,            // a lifecycle step called out of order
  Data,             // a missing, truncated or malformed data file
  Checkpoint,       // a corrupt or incompatible checkpoint
  Config,           // a run file that cannot be read
  Io,               // the file system said no
  Unsupported,      // the backend cannot run this op / dtype
  Backend,          // a library call (oneDNN, CUDA, cuDNN, cuBLAS, NCCL, MPI) failed
  Numeric,          // training diverged: a non-finite loss, or AMP's scale stuck at its floor
  Internal,         // a bug in kiln
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace kiln

// KILN_CHECK(cond, Kind, "text ", value, " more text") throws kiln::Error(ErrorKind::Kind, ...).
#define KILN_CHECK(cond, KIND, ...)                                                      \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::kiln::Error(::kiln::ErrorKind::KIND, ::kiln::detail::concat(__VA_ARGS__)); \
    }                                                                                    \
  } while (0)

#define KILN_FAIL(KIND, ...) \
  throw ::kiln::Error(::kiln::ErrorKind::KIND, ::kiln::detail::concat(__VA_ARGS__))
