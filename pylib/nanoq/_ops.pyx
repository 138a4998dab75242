# cython: language_level=3
# distutils: language = c++
"""Binding over the op test harness (cuda_core/op_harness/op_runner.h).

Generic: the ops, their arguments and their checks come from the core's op
table (cuda_core/op_harness/op_table.cpp); nothing here is written per op.
Tests use it through nanoq.testing.OpRunner. Every call into the core
releases the GIL.
"""
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy
from libcpp cimport bool as cbool
from libcpp.map cimport map as cmap
from libcpp.string cimport string
from libcpp.vector cimport vector

import numpy as np

from nanoq._core import NanoqError, OutOfMemoryError


cdef extern from "binding_errors.h":
    void nanoq_raise_py_error()
    void nanoq_set_error_types(object error, object oom_error)

nanoq_set_error_types(NanoqError, OutOfMemoryError)


cdef extern from "op_harness/op_runner.h" namespace "nanoq::ops" nogil:
    cdef enum class CHostType "nanoq::ops::HostType":
        F32 "nanoq::ops::HostType::F32"
        I32 "nanoq::ops::HostType::I32"
        F64 "nanoq::ops::HostType::F64"

    cdef cppclass CHostArray "nanoq::ops::HostArray":
        string name
        CHostType type
        vector[int64_t] shape
        const void* data

    cdef cppclass CScalars "nanoq::ops::Scalars":
        cmap[string, int64_t] ints
        cmap[string, double] floats
        cmap[string, cbool] bools
        cmap[string, uint64_t] seeds
        cmap[string, string] dtypes

    cdef cppclass CHostResult "nanoq::ops::HostResult":
        string name
        CHostType type
        vector[int64_t] shape
        vector[unsigned char] bytes

    cdef cppclass CArgInfo "nanoq::ops::ArgInfo":
        string name, role, shape, host_dtype, device_dtype, default_value, default_from
        cbool required

    cdef cppclass COpInfo "nanoq::ops::OpInfo":
        string name, doc
        vector[CArgInfo] args
        vector[string] results

    vector[COpInfo] describe_ops() except +nanoq_raise_py_error
    vector[string] core_stat_slots "nanoq::ops::stat_slots"()
    int core_gather_stride "nanoq::ops::gather_stride"()

    cdef cppclass COpRunner "nanoq::ops::OpRunner":
        COpRunner(const string&, int, int) except +nanoq_raise_py_error
        vector[CHostResult] run(const string&, const vector[CHostArray]&,
                                const CScalars&) except +nanoq_raise_py_error
        double time(const string&, const vector[CHostArray]&, const CScalars&,
                    int) except +nanoq_raise_py_error


# HostType's values (op_runner.h) by host dtype, and back.
_HOST_TYPES = {"float32": 0, "int32": 1, "float64": 2}
_NUMPY = {0: np.float32, 1: np.int32, 2: np.float64}


def stat_slots():
    """Names of the cross_entropy statistics slots, in order (tuple of str)."""
    return tuple(s.decode() for s in core_stat_slots())


def gather_stride():
    """Width of a row of optimizer_scale's `gathered`: the slots, then the sum of squares."""
    return core_gather_stride()


def op_table():
    """The ops of the harness: {name: dict(doc, args, results)}, args a list
    of dicts name, role ("input", "in_out", "output", "int", "float", "bool",
    "seed", "dtype"), shape, host_dtype, device_dtype, default (text, "" if
    none), default_from (the argument whose value is the default, "" if
    none) and required, in the order of the call."""
    table = {}
    for op in describe_ops():
        args = [dict(name=a.name.decode(), role=a.role.decode(), shape=a.shape.decode(),
                     host_dtype=a.host_dtype.decode(), device_dtype=a.device_dtype.decode(),
                     default=a.default_value.decode(), default_from=a.default_from.decode(),
                     required=a.required) for a in op.args]
        table[op.name.decode()] = dict(doc=op.doc.decode(), args=args, results=[r.decode() for r in op.results])
    return table


cdef object _convert(dict tensors, dict scalars, vector[CHostArray]& arrays, CScalars& s):
    """Fills arrays and s from run()'s arguments; returns the arrays to keep alive."""
    cdef CHostArray array
    keep = []
    for name, (value, host_dtype) in tensors.items():
        array.name = name.encode()
        array.type = <CHostType><int>_HOST_TYPES[host_dtype]
        array.shape = [int(d) for d in value.shape]
        array.data = <const void*><uintptr_t>value.ctypes.data
        arrays.push_back(array)
        keep.append(value)
    for name, (role, value) in scalars.items():
        key = name.encode()
        if role == "int":
            s.ints[key] = value
        elif role == "float":
            s.floats[key] = value
        elif role == "bool":
            s.bools[key] = value
        elif role == "seed":
            s.seeds[key] = value
        else:
            s.dtypes[key] = value.encode()
    return keep


cdef class NativeOpRunner:
    """One backend's op runner. Use nanoq.testing.OpRunner, which checks the
    Python types of the arguments and names them as the table does."""

    cdef COpRunner* _runner

    def __cinit__(self, str backend, int device, int threads):
        cdef string name = backend.encode()
        with nogil:
            self._runner = new COpRunner(name, device, threads)

    def __dealloc__(self):
        cdef COpRunner* runner = self._runner
        self._runner = NULL
        if runner != NULL:
            with nogil:
                del runner

    def run(self, str op, dict tensors, dict scalars):
        """Runs `op`. tensors: {name: (C-contiguous numpy array, host dtype
        name)}; scalars: {name: (role, value)}. Returns {name: new array}
        of the op's results, in order."""
        cdef vector[CHostArray] arrays
        cdef CScalars s
        keep = _convert(tensors, scalars, arrays, s)
        cdef string op_name = op.encode()
        cdef vector[CHostResult] results
        with nogil:
            results = self._runner.run(op_name, arrays, s)
        out = {}
        cdef size_t i
        for i in range(results.size()):
            r = np.empty(tuple(results[i].shape), dtype=_NUMPY[<int>results[i].type])
            if results[i].bytes.size() != r.nbytes:
                raise NanoqError(f"{op}: result {results[i].name.decode()} has {results[i].bytes.size()} bytes, "
                                 f"expected {r.nbytes}")
            memcpy(<void*><uintptr_t>r.ctypes.data, results[i].bytes.data(), r.nbytes)
            out[results[i].name.decode()] = r
        return out

    def time(self, str op, dict tensors, dict scalars, int repeats):
        """Mean seconds of one run of `op` (arguments as for run) over
        `repeats` back-to-back runs after one warm-up run on the device."""
        cdef vector[CHostArray] arrays
        cdef CScalars s
        keep = _convert(tensors, scalars, arrays, s)
        cdef string op_name = op.encode()
        cdef double seconds
        with nogil:
            seconds = self._runner.time(op_name, arrays, s, repeats)
        return seconds
