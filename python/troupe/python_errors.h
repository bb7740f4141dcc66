// One exception family for the extension modules: a bad argument raises
// troupe.exceptions.InvalidArgumentError (a ValueError) and one of the wrong type
// ArgumentTypeError (a TypeError), both TroupeErrors whose code is INVALID_ARGUMENT. They are
// thrown as C++ exceptions (a thread without the GIL may throw) and translated where Python
// gets them back.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace troupe::python {

struct InvalidArgument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct WrongType : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `fallback`: Python's own base of `type`, raised if troupe.exceptions cannot be imported.
inline void setTroupeError(const char* type, PyObject* fallback, const char* message) {
  namespace py = pybind11;
  try {
    py::object cls = py::module_::import("troupe.exceptions").attr(type);
    py::object error = cls(message);
    error.attr("code") = "INVALID_ARGUMENT";
    PyErr_SetObject(cls.ptr(), error.ptr());
  } catch (py::error_already_set&) {  // troupe.exceptions not importable: Python's own types
    PyErr_SetString(fallback, message);
  }
}

// Called once by each module (translators are shared; a second registration is harmless).
inline void registerErrors() {
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      setTroupeError("InvalidArgumentError", PyExc_ValueError, e.what());
    } catch (const WrongType& e) {
      setTroupeError("ArgumentTypeError", PyExc_TypeError, e.what());
    }
  });
}

}  // namespace troupe::python
