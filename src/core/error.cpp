#include "kiln/core/error.h"

namespace kiln {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument:
      return "invalid argument";
    case ErrorKind::Model:
      return "model error";
    case ErrorKind::Shape:
      return "shape error";
    case ErrorKind::Memory:
      return "memory plan error";
    case ErrorKind::State:
      return "lifecycle error";
    case ErrorKind::Data:
      return "data error";
    case ErrorKind::Checkpoint:
      return "checkpoint error";
    case ErrorKind::Config:
      return "config error";
    case ErrorKind::Io:
      return "i/o error";
    case ErrorKind::Unsupported:
      return "unsupported";
    case ErrorKind::Backend:
      return "backend error";
    case ErrorKind::Numeric:
      return "divergence";
    case ErrorKind::Internal:
      return "internal error";
  }
  return "error";
}

}  // namespace kiln
