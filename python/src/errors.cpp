// kiln::Error as Python exceptions: one kiln.Error base, and a subclass per family that also
// derives from the builtin a Python user catches (ValueError, FileNotFoundError, RuntimeError).
#include <Python.h>

#include "bind.h"
#include "kiln/core/error.h"

namespace kiln::py {

namespace {

PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_not_found = nullptr;
PyObject* g_runtime = nullptr;

PyObject* python_type(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument:
    case ErrorKind::Model:
    case ErrorKind::Shape:
    case ErrorKind::Config:
    case ErrorKind::Checkpoint:
    case ErrorKind::Data:
      return g_invalid;
    case ErrorKind::Io:
      return g_not_found;
    default:
      return g_runtime;  // State, Memory, Unsupported, Backend, Numeric, Internal
  }
}

PyObject* make_type(nb::module_& m, const char* name, const char* doc, PyObject* builtin) {
  nb::object bases = nb::make_tuple(nb::handle(g_error), nb::handle(builtin));
  PyObject* t =
      PyErr_NewExceptionWithDoc((std::string("kiln.") + name).c_str(), doc, bases.ptr(), nullptr);
  if (!t) throw nb::python_error();
  m.attr(name) = nb::handle(t);
  return t;
}

}  // namespace

void bind_errors(nb::module_& m) {
  g_error = PyErr_NewExceptionWithDoc(
      "kiln.Error", "Base of every error kiln raises; .kind names kiln's ErrorKind.",
      PyExc_Exception, nullptr);
  if (!g_error) throw nb::python_error();
  m.attr("Error") = nb::handle(g_error);
  g_invalid =
      make_type(m, "InvalidArgumentError",
                "A bad argument, model, shape, run file, checkpoint or data file (a ValueError).",
                PyExc_ValueError);
  g_not_found =
      make_type(m, "FileError",
                "The file system said no: a missing or unreadable file (a FileNotFoundError).",
                PyExc_FileNotFoundError);
  g_runtime = make_type(m, "DeviceError",
                        "The device or a library failed, a step came out of order, or training "
                        "diverged (a RuntimeError).",
                        PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = python_type(e.kind());
      nb::object err = nb::steal(PyObject_CallFunction(type, "s", e.what()));
      if (!err.is_valid()) return;  // the constructor raised; that error stands
      nb::setattr(err, "kind", nb::str(error_kind_name(e.kind())));
      PyErr_SetObject(type, err.ptr());
    }
  });
}

}  // namespace kiln::py
