# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Binding over the core's public header (cuda_core/include/nanoq/trainer.h).

Arrays are checked here (dtype, shape, contiguity) before any pointer reaches
C++; token values are checked by the Python layer (nanoq.trainer). Every call
into the core releases the GIL.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector

import numpy as np


class NanoqError(RuntimeError):
    """A failure inside the nanoq core (not a bad argument)."""


class OutOfMemoryError(NanoqError):
    """An allocation did not fit; the message names the tensor and its context."""


cdef extern from "binding_errors.h":
    void nanoq_raise_py_error()
    void nanoq_set_error_types(object error, object oom_error)

nanoq_set_error_types(NanoqError, OutOfMemoryError)


cdef extern from "nanoq/trainer.h" namespace "nanoq" nogil:
    cdef cppclass CModelConfig "nanoq::ModelConfig":
        int vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim
        double rope_theta
        cbool rope_llama3
        double rope_factor, rope_low_freq_factor, rope_high_freq_factor
        int rope_original_max_position
        float rms_norm_eps
        cbool tie_embeddings, qkv_bias, o_bias, qk_norm

    cdef cppclass CTrainOptions "nanoq::TrainOptions":
        string backend, dtype, master_dtype, optimizer_dtype
        int devices, batch_size, seq_len, grad_accum, threads
        float z_loss
        uint64_t seed

    cdef cppclass CUpdateParams "nanoq::UpdateParams":
        float lr, beta1, beta2, weight_decay, grad_clip, eps

    cdef cppclass CStepStats "nanoq::StepStats":
        double loss, loss_1k, z_loss, grad_norm, lse_max, lse_mean
        int64_t tokens

    cdef cppclass CParameterInfo "nanoq::ParameterInfo":
        string name
        vector[int64_t] shape
        cbool weight_decay
        int64_t offset

    cdef cppclass CAllocationInfo "nanoq::AllocationInfo":
        string context, name, kind
        size_t bytes

    cdef cppclass CStackInfo "nanoq::StackInfo":
        size_t capacity, high_water
        vector[pair[string, size_t]] live_at_high_water

    cdef cppclass CTrainer "nanoq::Trainer":
        CTrainer(const CModelConfig&, const CTrainOptions&) except +nanoq_raise_py_error
        int world_size()
        vector[CParameterInfo] parameters()
        void set_parameter(int, const float*) except +nanoq_raise_py_error
        void get_parameter(int, float*) except +nanoq_raise_py_error
        void get_gradient(int, float*) except +nanoq_raise_py_error
        void step(const int32_t*, const int32_t*, int) except +nanoq_raise_py_error
        CStepStats validate(const int32_t*, const int32_t*, int) except +nanoq_raise_py_error
        CStepStats update(const CUpdateParams&) except +nanoq_raise_py_error
        int micro_steps()
        int optimizer_steps()
        vector[CAllocationInfo] allocations(int) except +nanoq_raise_py_error
        CStackInfo stack_info(int) except +nanoq_raise_py_error
        void inject_fault(int)

    cbool has_backend(const string&)
    int backend_device_count(const string&) except +nanoq_raise_py_error


def backend_built(str name):
    """Whether backend `name` ("cpu", "cuda") is compiled into this install (no loading)."""
    return has_backend(name.encode())


def device_count(str name):
    """Devices backend `name` can use now. Loads its library: raises ValueError
    if it is not built, NanoqError if it cannot be loaded."""
    cdef string n = name.encode()
    cdef int count
    with nogil:
        count = backend_device_count(n)
    return count


cdef dict _stats_dict(const CStepStats& s):
    return dict(loss=s.loss, loss_1k=s.loss_1k, z_loss=s.z_loss, grad_norm=s.grad_norm,
                lse_max=s.lse_max, lse_mean=s.lse_mean, tokens=s.tokens)


cdef class CoreTrainer:
    """Owns one C++ Trainer. Use nanoq.Trainer, which validates arguments."""

    cdef CTrainer* _trainer
    cdef readonly int batch_rows
    cdef readonly int seq_len

    def __cinit__(self, dict config, dict options):
        cdef CModelConfig c
        cdef CTrainOptions o
        c.vocab_size = config["vocab_size"]
        c.hidden_size = config["hidden_size"]
        c.intermediate_size = config["intermediate_size"]
        c.num_layers = config["num_hidden_layers"]
        c.num_heads = config["num_attention_heads"]
        c.num_kv_heads = config["num_key_value_heads"]
        c.head_dim = config["head_dim"]
        c.rope_theta = config["rope_theta"]
        scaling = config["rope_scaling"]
        c.rope_llama3 = scaling is not None
        if scaling is not None:
            c.rope_factor = scaling["factor"]
            c.rope_low_freq_factor = scaling["low_freq_factor"]
            c.rope_high_freq_factor = scaling["high_freq_factor"]
            c.rope_original_max_position = scaling["original_max_position_embeddings"]
        c.rms_norm_eps = config["rms_norm_eps"]
        c.tie_embeddings = config["tie_word_embeddings"]
        c.qkv_bias = config["qkv_bias"]
        c.o_bias = config["o_bias"]
        c.qk_norm = config["qk_norm"]
        o.backend = options["backend"].encode()
        o.devices = options["devices"]
        o.batch_size = options["batch_size"]
        o.seq_len = options["seq_len"]
        o.grad_accum = options["grad_accum"]
        o.threads = options["threads"]
        o.z_loss = options["z_loss"]
        o.seed = options["seed"]
        o.dtype = options["dtype"].encode()
        o.master_dtype = options["master_dtype"].encode()
        o.optimizer_dtype = options["optimizer_dtype"].encode()
        self.batch_rows = o.devices * o.batch_size
        self.seq_len = o.seq_len
        with nogil:
            self._trainer = new CTrainer(c, o)

    def __dealloc__(self):
        self.close()

    def close(self):
        cdef CTrainer* trainer = self._trainer
        self._trainer = NULL
        if trainer != NULL:
            with nogil:
                del trainer

    cdef CTrainer* _get(self) except NULL:
        if self._trainer == NULL:
            raise RuntimeError("this Trainer is closed")
        return self._trainer

    @property
    def world_size(self):
        return self._get().world_size()

    @property
    def micro_steps(self):
        return self._get().micro_steps()

    @property
    def optimizer_steps(self):
        return self._get().optimizer_steps()

    def parameters(self):
        """[(name, shape, weight_decay)] in the core's flat-buffer order."""
        cdef CTrainer* t = self._get()
        return [(p.name.decode(), tuple(p.shape), p.weight_decay) for p in t.parameters()]

    def set_parameter(self, int index, const float[::1] data):
        cdef CTrainer* t = self._get()
        self._check_numel(index, data.shape[0])
        with nogil:
            t.set_parameter(index, &data[0])

    def get_parameter(self, int index):
        return self._read(index, False)

    def get_gradient(self, int index):
        return self._read(index, True)

    cdef _read(self, int index, cbool gradient):
        cdef CTrainer* t = self._get()
        shape = tuple(t.parameters()[index].shape)
        out = np.empty(shape, dtype=np.float32)
        cdef float[::1] view = out.reshape(-1)
        with nogil:
            if gradient:
                t.get_gradient(index, &view[0])
            else:
                t.get_parameter(index, &view[0])
        return out

    def _check_numel(self, int index, Py_ssize_t n):
        cdef CTrainer* t = self._get()
        if index < 0 or index >= <int>t.parameters().size():
            raise ValueError(f"parameter index {index} out of range")
        cdef int64_t expected = 1
        for d in t.parameters()[index].shape:
            expected *= d
        if n != expected:
            raise ValueError(f"parameter {index} has {expected} elements, got {n}")

    def _check_batch_shape(self, Py_ssize_t rows, Py_ssize_t cols):
        if rows != self.batch_rows or cols != self.seq_len:
            raise ValueError(f"batch must have shape ({self.batch_rows}, {self.seq_len}), got ({rows}, {cols})")

    def step(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets):
        """Host (numpy) batch: int32 C-contiguous [devices*batch_size, seq_len]."""
        cdef CTrainer* t = self._get()
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        with nogil:
            t.step(&inputs[0, 0], &targets[0, 0], -1)

    def validate(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        with nogil:
            s = t.validate(&inputs[0, 0], &targets[0, 0], -1)
        return _stats_dict(s)

    def step_device(self, uintptr_t inputs, uintptr_t targets, int device):
        """Device batch: pointers to int32 C-contiguous [devices*batch_size,
        seq_len] arrays in the memory of `device` (checked by the caller)."""
        cdef CTrainer* t = self._get()
        with nogil:
            t.step(<const int32_t*>inputs, <const int32_t*>targets, device)

    def validate_device(self, uintptr_t inputs, uintptr_t targets, int device):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        with nogil:
            s = t.validate(<const int32_t*>inputs, <const int32_t*>targets, device)
        return _stats_dict(s)

    def update(self, float lr, float beta1, float beta2, float weight_decay, float grad_clip, float eps):
        cdef CTrainer* t = self._get()
        cdef CUpdateParams p
        cdef CStepStats s
        p.lr = lr
        p.beta1 = beta1
        p.beta2 = beta2
        p.weight_decay = weight_decay
        p.grad_clip = grad_clip
        p.eps = eps
        with nogil:
            s = t.update(p)
        return _stats_dict(s)

    def allocations(self, int device):
        cdef CTrainer* t = self._get()
        return [dict(context=a.context.decode(), name=a.name.decode(), bytes=a.bytes, kind=a.kind.decode())
                for a in t.allocations(device)]

    def stack_info(self, int device):
        cdef CTrainer* t = self._get()
        cdef CStackInfo s = t.stack_info(device)
        return dict(capacity=s.capacity, high_water=s.high_water,
                    live_at_high_water=[(e.first.decode(), e.second) for e in s.live_at_high_water])

    def inject_fault(self, int rank):
        self._get().inject_fault(rank)
