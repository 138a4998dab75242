// Translates a C++ exception in flight into the matching Python exception.
// Used by _core.pyx and _ops.pyx as the `except +` handler of every call
// into the core (each extension has its own copy of the two types below).
#pragma once

#include <Python.h>

#include <new>

#include "nanoq/errors.h"

static PyObject* nanoq_error_type = PyExc_RuntimeError;
static PyObject* nanoq_oom_error_type = PyExc_MemoryError;

static void nanoq_set_error_types(PyObject* error, PyObject* oom_error) {
    Py_INCREF(error);
    Py_INCREF(oom_error);
    nanoq_error_type = error;
    nanoq_oom_error_type = oom_error;
}

static void nanoq_raise_py_error() {
    try {
        throw;
    } catch (const nanoq::InvalidArgument& e) {
        PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const nanoq::OutOfMemory& e) {
        PyErr_SetString(nanoq_oom_error_type, e.what());
    } catch (const std::bad_alloc&) {
        PyErr_SetString(nanoq_oom_error_type, "out of host memory inside the nanoq core");
    } catch (const std::exception& e) {
        PyErr_SetString(nanoq_error_type, e.what());
    } catch (...) {
        PyErr_SetString(nanoq_error_type, "unknown failure inside the nanoq core");
    }
}
