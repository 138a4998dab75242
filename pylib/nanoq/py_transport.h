// A ProcessTransport over a Python object (nanoq.distributed.MPITransport:
// mpi4py underneath), for _core.pyx. The core calls it from its worker and
// communication threads with the GIL released; each call takes the GIL,
// calls the object's method with buffers over the core's memory (no copy),
// and turns a Python exception into a NanoqError carrying its text.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "nanoq/errors.h"
#include "nanoq/transport.h"

class NanoqPyTransport final : public nanoq::ProcessTransport {
public:
    // Takes a reference to `object`, whose rank and size are read now.
    NanoqPyTransport(PyObject* object, int rank, int size) : object_(object), rank_(rank), size_(size) {
        Py_INCREF(object_);
    }
    ~NanoqPyTransport() override {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(object_);
        PyGILState_Release(gil);
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }

    void alltoallv(const void* send, const std::vector<std::int64_t>& send_bytes, void* recv,
                   const std::vector<std::int64_t>& recv_bytes) override {
        std::int64_t sent = 0, received = 0;
        for (std::int64_t n : send_bytes) sent += n;
        for (std::int64_t n : recv_bytes) received += n;
        PyGILState_STATE gil = PyGILState_Ensure();
        // memoryviews need a non-null pointer even for zero bytes.
        static char empty = 0;
        PyObject* send_view = PyMemoryView_FromMemory(sent ? const_cast<char*>(static_cast<const char*>(send)) : &empty,
                                                      sent, PyBUF_READ);
        PyObject* recv_view = PyMemoryView_FromMemory(received ? static_cast<char*>(recv) : &empty, received,
                                                      PyBUF_WRITE);
        PyObject* send_counts = counts(send_bytes);
        PyObject* recv_counts = counts(recv_bytes);
        PyObject* result = nullptr;
        if (send_view && recv_view && send_counts && recv_counts)
            result = PyObject_CallMethod(object_, "alltoallv", "OOOO", send_view, send_counts, recv_view, recv_counts);
        Py_XDECREF(send_view);
        Py_XDECREF(recv_view);
        Py_XDECREF(send_counts);
        Py_XDECREF(recv_counts);
        finish(result, gil, "alltoallv");
    }

    void barrier() override {
        PyGILState_STATE gil = PyGILState_Ensure();
        finish(PyObject_CallMethod(object_, "barrier", nullptr), gil, "barrier");
    }

private:
    PyObject* object_;
    int rank_, size_;

    static PyObject* counts(const std::vector<std::int64_t>& values) {
        PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
        if (!list) return nullptr;
        for (std::size_t i = 0; i < values.size(); ++i)
            PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(values[i]));
        return list;
    }

    // Releases `result` and the GIL; throws the pending Python error's text.
    static void finish(PyObject* result, PyGILState_STATE gil, const char* what) {
        if (result) {
            Py_DECREF(result);
            PyGILState_Release(gil);
            return;
        }
        std::string message = std::string("process transport ") + what + " failed";
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (value) {
            if (PyObject* text = PyObject_Str(value)) {
                if (const char* utf8 = PyUnicode_AsUTF8(text)) message += std::string(": ") + utf8;
                Py_DECREF(text);
            }
        }
        PyErr_Clear();
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        PyGILState_Release(gil);
        throw nanoq::NanoqError(message);
    }
};
