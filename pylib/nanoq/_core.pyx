# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Binding over the core's public header (cuda_core/include/nanoq/trainer.h).

Arrays are checked here (dtype, shape, contiguity) before any pointer reaches
C++; token values are checked by the Python layer (nanoq.trainer). Every call
into the core releases the GIL.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
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


cdef extern from "nanoq/options.h" namespace "nanoq" nogil:
    cdef cppclass CPrecision "nanoq::Precision":
        pass

    cdef cppclass CRecomputeSet "nanoq::RecomputeSet":
        uint32_t bits

    cdef cppclass COffloadSet "nanoq::OffloadSet":
        uint32_t bits

    cdef cppclass CLoraTargetSet "nanoq::LoraTargetSet":
        uint32_t bits

    cdef cppclass COptionKind "nanoq::OptionKind":
        pass

    cdef cppclass COptionChoice "nanoq::OptionChoice":
        string name, help
        vector[string] implies

    cdef cppclass COptionLimit "nanoq::OptionLimit":
        cbool present, inclusive
        double value

    cdef cppclass COptionSpec "nanoq::OptionSpec":
        string name, help
        COptionKind kind
        vector[COptionChoice] choices
        COptionLimit minimum, maximum

    cdef cppclass COptionRule "nanoq::OptionRule":
        string name, message
        vector[string] options

    cdef cppclass COptionSchema "nanoq::OptionSchema":
        vector[COptionSpec] options
        vector[COptionRule] rules

    const COptionSchema& core_option_schema "nanoq::option_schema"() except +nanoq_raise_py_error
    const char* option_kind_name(COptionKind) except +nanoq_raise_py_error
    CPrecision precision_named(const string&, const string&) except +nanoq_raise_py_error
    CRecomputeSet recompute_named(const vector[string]&) except +nanoq_raise_py_error
    COffloadSet offload_named(const vector[string]&) except +nanoq_raise_py_error
    CLoraTargetSet lora_targets_named(const vector[string]&) except +nanoq_raise_py_error


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
        string backend
        CPrecision dtype, master_dtype, optimizer_dtype
        CRecomputeSet recompute
        COffloadSet offload
        int devices, batch_size, seq_len, grad_accum, threads, zero_stage
        float z_loss
        int lora_rank
        float lora_alpha, lora_dropout
        CLoraTargetSet lora_targets
        uint64_t seed
        size_t memory_limit

    cdef cppclass CUpdateParams "nanoq::UpdateParams":
        float lr, beta1, beta2, weight_decay, grad_clip, eps

    cdef cppclass CStepStats "nanoq::StepStats":
        double loss, loss_1k, z_loss, grad_norm, lse_max, lse_mean
        int64_t tokens
        cbool skipped

    cdef cppclass CParameterInfo "nanoq::ParameterInfo":
        string name
        vector[int64_t] shape
        cbool weight_decay
        int64_t offset
        cbool trainable

    cdef cppclass CAllocationInfo "nanoq::AllocationInfo":
        string context, name, kind
        size_t bytes
        cbool exact

    cdef cppclass CDevicePlan "nanoq::DevicePlan":
        vector[CAllocationInfo] allocations
        size_t stack_capacity

    cdef cppclass CMemoryInfo "nanoq::MemoryInfo":
        size_t allocated, limit, free, total
        cbool known

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
        void get_optimizer_state(int, int, float*) except +nanoq_raise_py_error
        void set_optimizer_state(int, int, const float*) except +nanoq_raise_py_error
        void set_optimizer_steps(int) except +nanoq_raise_py_error
        void step(const int32_t*, const int32_t*, int, uintptr_t, uintptr_t) except +nanoq_raise_py_error
        CStepStats validate(const int32_t*, const int32_t*, int, uintptr_t, uintptr_t) except +nanoq_raise_py_error
        CStepStats update(const CUpdateParams&) except +nanoq_raise_py_error
        int micro_steps()
        int optimizer_steps()
        vector[CAllocationInfo] allocations(int) except +nanoq_raise_py_error
        CStackInfo stack_info(int) except +nanoq_raise_py_error
        CMemoryInfo memory_info(int) except +nanoq_raise_py_error
        void inject_fault(int)

    vector[CDevicePlan] core_plan_memory "nanoq::plan_memory"(const CModelConfig&, const CTrainOptions&,
                                                              cbool) except +nanoq_raise_py_error
    vector[CParameterInfo] core_parameter_layout "nanoq::parameter_layout"(const CModelConfig&) \
        except +nanoq_raise_py_error
    cbool has_backend(const string&)
    int backend_device_count(const string&) except +nanoq_raise_py_error

    cdef cppclass CCpuGemm "nanoq::CpuGemm":
        string name
        cbool openblas_built
    CCpuGemm core_cpu_gemm "nanoq::cpu_gemm"() except +nanoq_raise_py_error


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


def cpu_gemm():
    """The sgemm a cpu backend created now runs, as dict(name="openblas" or
    "portable", openblas_built=bool). NANOQ_CPU_GEMM ("portable", "openblas")
    overrides the default (OpenBLAS when this build has it); ValueError for
    a value this build cannot honour."""
    cdef CCpuGemm gemm = core_cpu_gemm()
    return dict(name=gemm.name.decode(), openblas_built=gemm.openblas_built)


# What CoreTrainer._read copies out; 0..2 are the core's optimizer state kinds.
cdef enum:
    _WEIGHTS = -1
    _GRADIENTS = -2


cdef dict _stats_dict(const CStepStats& s):
    return dict(loss=s.loss, loss_1k=s.loss_1k, z_loss=s.z_loss, grad_norm=s.grad_norm,
                lse_max=s.lse_max, lse_mean=s.lse_mean, tokens=s.tokens, skipped=s.skipped)


cdef CModelConfig _model_config(dict config) except *:
    """The core's ModelConfig from nanoq.ModelConfig.to_core()."""
    cdef CModelConfig c
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
    return c


def plan_memory(dict config, dict options, cbool ask_libraries=True):
    """What CoreTrainer(config, options) would allocate, per device, computed
    by the core without a device (nanoq::plan_memory): a list with one dict
    per device, allocations (dicts context, name, bytes, kind, exact, in
    allocation order) and stack_capacity. Devices whose lists are equal
    share one list object. Raises as the Trainer does for bad options, and
    OutOfMemoryError where memory_limit would be exceeded."""
    cdef CModelConfig c = _model_config(config)
    cdef CTrainOptions o = _core_options(options)
    cdef vector[CDevicePlan] plans
    cdef CAllocationInfo a
    with nogil:
        plans = core_plan_memory(c, o, ask_libraries)
    out = []
    cdef size_t device
    for device in range(plans.size()):
        if device and _same_allocations(plans[device].allocations, plans[device - 1].allocations):
            allocations = out[device - 1]["allocations"]
        else:
            allocations = []
            for a in plans[device].allocations:
                allocations.append(dict(context=a.context.decode(), name=a.name.decode(), bytes=a.bytes,
                                        kind=a.kind.decode(), exact=a.exact))
        out.append(dict(allocations=allocations, stack_capacity=plans[device].stack_capacity))
    return out


cdef cbool _same_allocations(const vector[CAllocationInfo]& a, const vector[CAllocationInfo]& b) noexcept nogil:
    if a.size() != b.size():
        return False
    cdef size_t i
    for i in range(a.size()):
        if (a[i].bytes != b[i].bytes or a[i].exact != b[i].exact or a[i].name != b[i].name
                or a[i].context != b[i].context or a[i].kind != b[i].kind):
            return False
    return True


def parameter_layout(dict config):
    """The model's parameters in the core's flat-buffer order
    (nanoq::parameter_layout): a list of (Hugging Face name, shape tuple)."""
    cdef CModelConfig c = _model_config(config)
    return [(p.name.decode(), tuple(p.shape)) for p in core_parameter_layout(c)]


cdef extern from "nanoq/trainer.h" namespace "nanoq" nogil:
    void core_validate_options "nanoq::validate_options"(const CTrainOptions&, const vector[string]&) \
        except +nanoq_raise_py_error


cdef vector[string] _names(object names) except *:
    """The names of a tuple/list of strings, encoded (a TrainOptions set option)."""
    if isinstance(names, str):
        raise TypeError(f"option names must be a tuple of strings, got the string {names!r}")
    cdef vector[string] out
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"option names must be strings, got {name!r}")
        out.push_back(name.encode())
    return out


cdef CTrainOptions _core_options(dict options) except *:
    """The core's TrainOptions of a dict of nanoq.TrainOptions' fields (a
    missing key keeps the core's default; "lora" is a dict of LoraConfig's
    fields or None). Names become the core's enums and bit sets here, with
    the core's messages for unknown ones."""
    cdef CTrainOptions o
    for key, value in options.items():
        if key == "backend":
            o.backend = value.encode()
        elif key == "devices":
            o.devices = value
        elif key == "batch_size":
            o.batch_size = value
        elif key == "seq_len":
            o.seq_len = value
        elif key == "grad_accum":
            o.grad_accum = value
        elif key == "threads":
            o.threads = value
        elif key == "z_loss":
            o.z_loss = value
        elif key == "seed":
            o.seed = value
        elif key in ("dtype", "master_dtype", "optimizer_dtype"):
            precision = precision_named(key.encode(), value.encode())
            if key == "dtype":
                o.dtype = precision
            elif key == "master_dtype":
                o.master_dtype = precision
            else:
                o.optimizer_dtype = precision
        elif key == "memory_limit":
            o.memory_limit = value
        elif key == "recompute":
            o.recompute = recompute_named(_names(value))
        elif key == "offload":
            o.offload = offload_named(_names(value))
        elif key == "zero_stage":
            o.zero_stage = value
        elif key == "lora":
            if value:
                o.lora_rank = value["rank"]
                o.lora_alpha = value["alpha"]
                o.lora_dropout = value["dropout"]
                o.lora_targets = lora_targets_named(_names(value["targets"]))
        else:
            raise ValueError(f"unknown training option {key!r}")
    return o


_LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def check_options(dict options):
    """Applies every limit and cross-option rule of the core's schema
    (nanoq/options.h validate_options) to `options`, a dict of
    nanoq.TrainOptions' fields as CoreTrainer takes them ("lora": a dict of
    LoraConfig's fields, or None). Options absent from `options` are not
    checked, nor the rules involving them. Raises ValueError with the core's
    message."""
    cdef CTrainOptions o = _core_options(options)
    given = set(options) - {"lora"}
    if "lora" in options:
        given.update(_LORA_OPTIONS)
    cdef vector[string] absent = _names([spec["name"] for spec in _SCHEMA["options"] if spec["name"] not in given])
    with nogil:
        core_validate_options(o, absent)


cdef object _limit(const COptionLimit& limit):
    return dict(value=limit.value, inclusive=limit.inclusive) if limit.present else None


cdef list _decoded(const vector[string]& names):
    cdef size_t i
    return [names[i].decode() for i in range(names.size())]


def option_schema():
    """The core's option schema (nanoq/options.h): dict(options=[...],
    rules=[...]). Each option: dict(name, kind ("choice", "set", "integer",
    "number"), help, choices=[dict(name, help, implies=[names])], minimum,
    maximum (None or dict(value, inclusive))). Each rule: dict(name,
    options=[names], message)."""
    cdef const COptionSchema* schema = &core_option_schema()
    cdef size_t i, j
    options = []
    for i in range(schema.options.size()):
        choices = []
        for j in range(schema.options[i].choices.size()):
            choices.append(dict(name=schema.options[i].choices[j].name.decode(),
                                help=schema.options[i].choices[j].help.decode(),
                                implies=_decoded(schema.options[i].choices[j].implies)))
        options.append(dict(name=schema.options[i].name.decode(),
                            kind=option_kind_name(schema.options[i].kind).decode(),
                            help=schema.options[i].help.decode(), choices=choices,
                            minimum=_limit(schema.options[i].minimum), maximum=_limit(schema.options[i].maximum)))
    rules = []
    for i in range(schema.rules.size()):
        rules.append(dict(name=schema.rules[i].name.decode(), options=_decoded(schema.rules[i].options),
                          message=schema.rules[i].message.decode()))
    return dict(options=options, rules=rules)


_SCHEMA = option_schema()


def set_option_names(str option, names):
    """`names` (a tuple or list of strings) of set option `option`
    ("recompute", "offload", "lora_targets") as the core reads them: a tuple
    in the schema's order, without duplicates. Raises ValueError (the core's
    message) for an unknown name."""
    cdef vector[string] chosen = _names(names)
    cdef uint32_t bits
    if option == "recompute":
        bits = recompute_named(chosen).bits
    elif option == "offload":
        bits = offload_named(chosen).bits
    elif option == "lora_targets":
        bits = lora_targets_named(chosen).bits
    else:
        raise ValueError(f"{option!r} is not a set option; those are recompute, offload and lora_targets")
    spec = next(spec for spec in _SCHEMA["options"] if spec["name"] == option)
    return tuple(choice["name"] for i, choice in enumerate(spec["choices"]) if bits >> i & 1)


cdef class CoreTrainer:
    """Owns one C++ Trainer. Use nanoq.Trainer, which validates arguments."""

    cdef CTrainer* _trainer
    cdef readonly int batch_rows
    cdef readonly int seq_len

    def __cinit__(self, dict config, dict options):
        cdef CModelConfig c = _model_config(config)
        cdef CTrainOptions o = _core_options(options)
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
        """[(name, shape, weight_decay, trainable)]: the trainable parameters in
        the core's flat-buffer order, then (LoRA) the frozen ones."""
        cdef CTrainer* t = self._get()
        return [(p.name.decode(), tuple(p.shape), p.weight_decay, p.trainable) for p in t.parameters()]

    def set_parameter(self, int index, const float[::1] data):
        cdef CTrainer* t = self._get()
        self._check_numel(index, data.shape[0])
        with nogil:
            t.set_parameter(index, &data[0])

    def get_parameter(self, int index):
        return self._read(index, _WEIGHTS)

    def get_gradient(self, int index):
        return self._read(index, _GRADIENTS)

    def get_optimizer_state(self, int index, int kind):
        """kind: 0 master weights, 1 AdamW m, 2 AdamW v; full float32 tensor."""
        if kind not in (0, 1, 2):
            raise ValueError(f"optimizer state kind must be 0, 1 or 2, got {kind}")
        return self._read(index, kind)

    def set_optimizer_state(self, int index, int kind, const float[::1] data):
        cdef CTrainer* t = self._get()
        self._check_numel(index, data.shape[0])
        with nogil:
            t.set_optimizer_state(index, kind, &data[0])

    def set_optimizer_steps(self, int steps):
        self._get().set_optimizer_steps(steps)

    cdef _read(self, int index, int what):
        cdef CTrainer* t = self._get()
        if index < 0 or index >= <int>t.parameters().size():
            raise ValueError(f"parameter index {index} out of range")
        shape = tuple(t.parameters()[index].shape)
        out = np.empty(shape, dtype=np.float32)
        cdef float[::1] view = out.reshape(-1)
        with nogil:
            if what == _WEIGHTS:
                t.get_parameter(index, &view[0])
            elif what == _GRADIENTS:
                t.get_gradient(index, &view[0])
            else:
                t.get_optimizer_state(index, what, &view[0])
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
            t.step(&inputs[0, 0], &targets[0, 0], -1, 0, 0)

    def validate(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        with nogil:
            s = t.validate(&inputs[0, 0], &targets[0, 0], -1, 0, 0)
        return _stats_dict(s)

    def step_device(self, uintptr_t inputs, uintptr_t targets, int device, uintptr_t inputs_stream=0,
                    uintptr_t targets_stream=0):
        """Device batch: pointers to int32 C-contiguous [devices*batch_size,
        seq_len] arrays in the memory of `device` (checked by the caller),
        and the streams they are written on, as the CUDA Array Interface v3
        names them (0: none); the step's reads wait for those streams."""
        cdef CTrainer* t = self._get()
        with nogil:
            t.step(<const int32_t*>inputs, <const int32_t*>targets, device, inputs_stream, targets_stream)

    def validate_device(self, uintptr_t inputs, uintptr_t targets, int device, uintptr_t inputs_stream=0,
                        uintptr_t targets_stream=0):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        with nogil:
            s = t.validate(<const int32_t*>inputs, <const int32_t*>targets, device, inputs_stream, targets_stream)
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

    def memory_info(self, int device):
        cdef CTrainer* t = self._get()
        cdef CMemoryInfo m
        with nogil:
            m = t.memory_info(device)
        return dict(allocated=m.allocated, limit=m.limit, free=m.free if m.known else None,
                    total=m.total if m.known else None)

    def inject_fault(self, int rank):
        self._get().inject_fault(rank)


# ---------------------------------------------------------------------------
# OpRunner: one backend op per call on numpy arrays (nanoq/op_runner.h), the
# surface of the op-level parity tests (tests/test_ops.py, test_gpu_ops.py).
# Inputs are converted to C-contiguous float32 (tokens/targets int32; the
# statistics float64) copies; every method returns new arrays of those dtypes
# and never modifies its arguments.
# ---------------------------------------------------------------------------

cdef extern from "nanoq/op_runner.h" namespace "nanoq" nogil:
    cdef enum class COpDType "nanoq::OpDType":
        F32 "nanoq::OpDType::F32"
        BF16 "nanoq::OpDType::BF16"

    cdef cppclass COpRunner "nanoq::OpRunner":
        COpRunner(const string&, int, int) except +nanoq_raise_py_error
        @staticmethod
        vector[string] stat_slots()
        @staticmethod
        int gather_stride()
        void copy(float*, const float*, int64_t, COpDType, COpDType) except +nanoq_raise_py_error
        void fill(float*, int64_t, float, COpDType) except +nanoq_raise_py_error
        void matmul(float*, const float*, const float*, int, int, int, cbool, cbool, cbool, COpDType,
                    COpDType) except +nanoq_raise_py_error
        void add_bias(float*, const float*, int, int, COpDType) except +nanoq_raise_py_error
        void bias_backward(float*, const float*, int, int, COpDType) except +nanoq_raise_py_error
        void add(float*, const float*, const float*, int64_t, COpDType) except +nanoq_raise_py_error
        void accumulate(float*, const float*, int64_t, COpDType) except +nanoq_raise_py_error
        void scale_dropout(float*, const float*, int64_t, float, float, uint64_t, COpDType) except +nanoq_raise_py_error
        void embedding_forward(float*, const int32_t*, const float*, int, int, int,
                               COpDType) except +nanoq_raise_py_error
        void embedding_backward(float*, const float*, const int32_t*, int, int, int,
                                COpDType) except +nanoq_raise_py_error
        void rmsnorm_forward(float*, float*, const float*, const float*, int, int, float,
                             COpDType) except +nanoq_raise_py_error
        void rmsnorm_backward(float*, float*, const float*, const float*, const float*, const float*, int, int,
                              cbool, cbool, COpDType) except +nanoq_raise_py_error
        void rope_forward(float*, const float*, int, int, int, int, COpDType) except +nanoq_raise_py_error
        void rope_backward(float*, const float*, int, int, int, int, COpDType) except +nanoq_raise_py_error
        void attention_forward(float*, float*, const float*, const float*, const float*, int, int, int, int, int,
                               COpDType) except +nanoq_raise_py_error
        void attention_backward(float*, float*, float*, const float*, const float*, const float*, const float*,
                                const float*, const float*, int, int, int, int, int,
                                COpDType) except +nanoq_raise_py_error
        void swiglu_forward(float*, const float*, const float*, int64_t, COpDType) except +nanoq_raise_py_error
        void swiglu_backward(float*, float*, const float*, const float*, const float*, int64_t, cbool,
                             COpDType) except +nanoq_raise_py_error
        void cross_entropy(float*, const int32_t*, double*, int, int, int, int, float, cbool,
                           COpDType) except +nanoq_raise_py_error
        void sum_squares(double*, const float*, int64_t) except +nanoq_raise_py_error
        void optimizer_scale(float*, const double*, int, float) except +nanoq_raise_py_error
        void adamw(float*, const float*, float*, float*, int64_t, float, float, float, float, float, float, int,
                   uint64_t, COpDType, COpDType) except +nanoq_raise_py_error


# The dtype of the loss statistics and sums of squares (nanoq/op_runner.h
# passes them as double), and their layout: the slot names in order and the
# width of a gathered row (the slots, then a rank's sum of squares).
STAT_DTYPE = np.float64


def stat_slots():
    """Names of the statistics slots, in order (tuple of str)."""
    return tuple(s.decode() for s in COpRunner.stat_slots())


def gather_stride():
    """Width of a row of the gathered statistics: the slots, then the sum of squares."""
    return COpRunner.gather_stride()


cdef COpDType _op_dtype(str name) except *:
    if name == "fp32":
        return COpDType.F32
    if name == "bf16":
        return COpDType.BF16
    raise ValueError(f'dtype must be "fp32" or "bf16", got {name!r}')


def _op_floats(x, str name, int ndim=-1, dtype=np.float32):
    """A C-contiguous float32 (or `dtype`) copy of x (a new array: the core may write to it)."""
    a = np.array(x, dtype=dtype, order="C", copy=True)
    if ndim >= 0 and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {a.shape})")
    return a


def _op_tokens(x, str name):
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int32)


def _op_check_shape(a, tuple shape, str name):
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")


def _op_rows(inp, int channels):
    """Rows of `inp` normalized over its last axis, which must be `channels` long."""
    last = inp.shape[inp.ndim - 1]  # (this file compiles with wraparound=False: no [-1])
    if last != channels:
        raise ValueError(f"inp's last axis ({last}) must match weight ({channels})")
    return inp.size // channels


cdef inline float* _fp(a):
    return <float*><uintptr_t>a.ctypes.data


cdef inline int32_t* _ip(a):
    return <int32_t*><uintptr_t>a.ctypes.data


cdef inline double* _dp(a):
    return <double*><uintptr_t>a.ctypes.data


cdef class OpRunner:
    """Runs single ops of one backend ("cpu", "cuda") on numpy arrays.

    For parity tests: feed two runners the same inputs and compare. Inputs
    are float32 arrays (tokens/targets integer); `dtype` ("fp32" or "bf16")
    is the device dtype of the op's activation/weight tensors (values are
    rounded to bf16 on the device); weight/bias/norm gradients, rstd, lse,
    cos/sin and AdamW's grad stay float32. The loss statistics (and
    optimizer_scale's gathered rows) are float64 (STAT_DTYPE); every other
    array a method returns is a new float32 one. Tensors an op overwrites
    start as NaN on the device, so an element the op never writes comes back
    NaN. Each call allocates its own device memory and blocks until the
    device is done.
    """

    cdef COpRunner* _runner
    cdef readonly str backend
    cdef readonly int device

    def __cinit__(self, str backend="cpu", int device=0, int threads=0):
        if backend != "cpu":
            from nanoq.backends import device_count
            device_count(backend)  # checks the name; loads the backend's GPU libraries
        cdef string name = backend.encode()
        with nogil:
            self._runner = new COpRunner(name, device, threads)
        self.backend = backend
        self.device = device

    def __dealloc__(self):
        cdef COpRunner* runner = self._runner
        self._runner = NULL
        if runner != NULL:
            with nogil:
                del runner

    @property
    def stat_slots(self):
        """Names of the cross_entropy statistics slots, in order (tuple of str)."""
        return stat_slots()

    @property
    def gather_stride(self):
        """Width of a row of optimizer_scale's `gathered`: the stat slots, then the sum of squares."""
        return gather_stride()

    def copy(self, x, str src_dtype="fp32", str dst_dtype="fp32"):
        """x (any shape) uploaded as src_dtype, converted on the device to
        dst_dtype, read back: float32, x's shape."""
        xa = _op_floats(x, "x")
        out = np.empty_like(xa)
        cdef COpDType s = _op_dtype(src_dtype), d = _op_dtype(dst_dtype)
        cdef float* po = _fp(out)
        cdef float* px = _fp(xa)
        cdef int64_t n = xa.size
        with nogil:
            self._runner.copy(po, px, n, s, d)
        return out

    def fill(self, shape, float value, str dtype="fp32"):
        """A device tensor of `shape` filled with value: float32 `shape`."""
        out = np.zeros(shape, dtype=np.float32)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef int64_t n = out.size
        with nogil:
            self._runner.fill(po, n, value, t)
        return out

    def matmul(self, a, b, cbool trans_a=False, cbool trans_b=False, accumulate_into=None, str dtype="fp32",
               out_dtype=None):
        """op(a) @ op(b) [M, N]: a is [M, K] ([K, M] with trans_a), b [K, N]
        ([N, K] with trans_b). With accumulate_into [M, N], returns
        accumulate_into + op(a) @ op(b) (accumulated on the device). The
        output's device dtype is out_dtype (default: dtype)."""
        aa = _op_floats(a, "a", 2)
        ba = _op_floats(b, "b", 2)
        cdef int M = aa.shape[1] if trans_a else aa.shape[0]
        cdef int K = aa.shape[0] if trans_a else aa.shape[1]
        cdef int N = ba.shape[0] if trans_b else ba.shape[1]
        cdef int Kb = ba.shape[1] if trans_b else ba.shape[0]
        if Kb != K:
            raise ValueError(f"inner dimensions differ: op(a) is [{M}, {K}], op(b) is [{Kb}, {N}]")
        cdef cbool accumulate = accumulate_into is not None
        if accumulate:
            out = _op_floats(accumulate_into, "accumulate_into")
            _op_check_shape(out, (M, N), "accumulate_into")
        else:
            out = np.empty((M, N), dtype=np.float32)
        cdef COpDType t = _op_dtype(dtype)
        cdef COpDType ot = _op_dtype(dtype if out_dtype is None else out_dtype)
        cdef float* po = _fp(out)
        cdef float* pa = _fp(aa)
        cdef float* pb = _fp(ba)
        with nogil:
            self._runner.matmul(po, pa, pb, M, N, K, trans_a, trans_b, accumulate, t, ot)
        return out

    def add_bias(self, out, bias, str dtype="fp32"):
        """out [rows, cols] + bias [cols] (broadcast over rows)."""
        res = _op_floats(out, "out", 2)
        ba = _op_floats(bias, "bias", 1)
        cdef int rows = res.shape[0], cols = res.shape[1]
        _op_check_shape(ba, (cols,), "bias")
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(res)
        cdef float* pb = _fp(ba)
        with nogil:
            self._runner.add_bias(po, pb, rows, cols, t)
        return res

    def bias_backward(self, dout, dbias=None, str dtype="fp32"):
        """dbias [cols] (default zeros, float32) + column sums of dout [rows, cols]."""
        da = _op_floats(dout, "dout", 2)
        cdef int rows = da.shape[0], cols = da.shape[1]
        res = np.zeros(cols, np.float32) if dbias is None else _op_floats(dbias, "dbias")
        _op_check_shape(res, (cols,), "dbias")
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pr = _fp(res)
        cdef float* pd = _fp(da)
        with nogil:
            self._runner.bias_backward(pr, pd, rows, cols, t)
        return res

    def add(self, a, b, str dtype="fp32"):
        """a + b, elementwise (same shapes)."""
        aa = _op_floats(a, "a")
        ba = _op_floats(b, "b")
        _op_check_shape(ba, aa.shape, "b")
        out = np.empty_like(aa)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef float* pa = _fp(aa)
        cdef float* pb = _fp(ba)
        cdef int64_t n = aa.size
        with nogil:
            self._runner.add(po, pa, pb, n, t)
        return out

    def accumulate(self, out, a, str dtype="fp32"):
        """out + a, computed in place on the device (same shapes)."""
        res = _op_floats(out, "out")
        aa = _op_floats(a, "a")
        _op_check_shape(aa, res.shape, "a")
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pr = _fp(res)
        cdef float* pa = _fp(aa)
        cdef int64_t n = res.size
        with nogil:
            self._runner.accumulate(pr, pa, n, t)
        return res

    def scale_dropout(self, x, float scale, float drop, seed, str dtype="fp32"):
        """x * scale with dropout: elements whose mask draw (seed, flat index)
        is below ``drop`` become 0, the others are scaled by 1 / (1 - drop)."""
        xa = _op_floats(x, "x")
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"drop must be in [0, 1), got {drop}")
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        out = np.empty_like(xa)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef float* pa = _fp(xa)
        cdef int64_t n = xa.size
        cdef uint64_t s = seed
        with nogil:
            self._runner.scale_dropout(po, pa, n, scale, drop, s, t)
        return out

    def embedding_forward(self, tokens, table, str dtype="fp32"):
        """table [vocab, C] rows picked by tokens (any shape): [*tokens.shape, C]."""
        tok = _op_tokens(tokens, "tokens")
        ta = _op_floats(table, "table", 2)
        cdef int vocab = ta.shape[0], channels = ta.shape[1]
        cdef int rows = tok.size
        out = np.empty(tok.shape + (channels,), dtype=np.float32)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef int32_t* pt = _ip(tok)
        cdef float* pta = _fp(ta)
        with nogil:
            self._runner.embedding_forward(po, pt, pta, rows, channels, vocab, t)
        return out

    def embedding_backward(self, dout, tokens, table_grad, str dtype="fp32"):
        """table_grad [vocab, C] (float32) + dout [*tokens.shape, C] scattered by tokens."""
        tok = _op_tokens(tokens, "tokens")
        res = _op_floats(table_grad, "table_grad", 2)
        cdef int vocab = res.shape[0], channels = res.shape[1]
        cdef int rows = tok.size
        da = _op_floats(dout, "dout")
        _op_check_shape(da, tok.shape + (channels,), "dout")
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pr = _fp(res)
        cdef float* pd = _fp(da)
        cdef int32_t* pt = _ip(tok)
        with nogil:
            self._runner.embedding_backward(pr, pd, pt, rows, channels, vocab, t)
        return res

    def rmsnorm_forward(self, inp, weight, float eps=1e-6, str dtype="fp32"):
        """(out, rstd): out = inp * rstd * weight over the last axis (C);
        rstd [inp.size // C] float32."""
        ia = _op_floats(inp, "inp")
        wa = _op_floats(weight, "weight", 1)
        cdef int channels = wa.shape[0]
        cdef int rows = _op_rows(ia, channels)
        out = np.empty_like(ia)
        rstd = np.empty(rows, dtype=np.float32)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef float* pr = _fp(rstd)
        cdef float* pi = _fp(ia)
        cdef float* pw = _fp(wa)
        with nogil:
            self._runner.rmsnorm_forward(po, pr, pi, pw, rows, channels, eps, t)
        return out, rstd

    def rmsnorm_backward(self, dout, inp, weight, rstd, dweight=None, dinp_accumulate_into=None,
                         cbool alias=False, str dtype="fp32"):
        """(dinp, dweight). dinp = d/dinp (+ dinp_accumulate_into when given,
        accumulated on the device); dweight [C] (float32) = dweight (default
        zeros) + d/dweight. With alias, the op gets one device tensor as both
        dout and dinp (not with dinp_accumulate_into)."""
        da = _op_floats(dout, "dout")
        ia = _op_floats(inp, "inp")
        wa = _op_floats(weight, "weight", 1)
        cdef int channels = wa.shape[0]
        cdef int rows = _op_rows(ia, channels)
        _op_check_shape(da, ia.shape, "dout")
        ra = _op_floats(rstd, "rstd")
        _op_check_shape(ra, (rows,), "rstd")
        dw = np.zeros(channels, np.float32) if dweight is None else _op_floats(dweight, "dweight")
        _op_check_shape(dw, (channels,), "dweight")
        cdef cbool accumulate = dinp_accumulate_into is not None
        if accumulate:
            dinp = _op_floats(dinp_accumulate_into, "dinp_accumulate_into")
            _op_check_shape(dinp, ia.shape, "dinp_accumulate_into")
        else:
            dinp = np.empty_like(ia)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pdi = _fp(dinp)
        cdef float* pdw = _fp(dw)
        cdef float* pd = _fp(da)
        cdef float* pi = _fp(ia)
        cdef float* pw = _fp(wa)
        cdef float* pr = _fp(ra)
        with nogil:
            self._runner.rmsnorm_backward(pdi, pdw, pd, pi, pw, pr, rows, channels, accumulate, alias, t)
        return dinp, dw

    def _rope(self, x, cos_sin, str dtype, cbool backward):
        res = _op_floats(x, "x", 4)
        cdef int batch = res.shape[0], time = res.shape[1], heads = res.shape[2], head_dim = res.shape[3]
        ca = _op_floats(cos_sin, "cos_sin", 3)
        _op_check_shape(ca, (time, head_dim // 2, 2), "cos_sin")
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pr = _fp(res)
        cdef float* pc = _fp(ca)
        with nogil:
            if backward:
                self._runner.rope_backward(pr, pc, batch, time, heads, head_dim, t)
            else:
                self._runner.rope_forward(pr, pc, batch, time, heads, head_dim, t)
        return res

    def rope_forward(self, x, cos_sin, str dtype="fp32"):
        """x [B, T, H, D] rotated (half-split pairs (i, i + D/2)) by the
        angles of cos_sin [T, D/2, 2] (cos, sin)."""
        return self._rope(x, cos_sin, dtype, False)

    def rope_backward(self, dx, cos_sin, str dtype="fp32"):
        """dx [B, T, H, D] rotated by the opposite angles (the gradient of rope_forward)."""
        return self._rope(dx, cos_sin, dtype, True)

    def _attention_shape(self, q, k, v):
        if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[3] != k.shape[3]:
            raise ValueError(f"q [B, T, H, D], k and v [B, T, Hkv, D] expected, got {q.shape}, {k.shape}, {v.shape}")
        return q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]

    def attention_forward(self, q, k, v, str dtype="fp32"):
        """(out, lse): causal softmax(q k^T / sqrt(D)) v with grouped kv heads.
        q [B, T, H, D], k, v [B, T, Hkv, D]; out [B, T, H, D]; lse [B, H, T] float32."""
        qa = _op_floats(q, "q", 4)
        ka = _op_floats(k, "k", 4)
        va = _op_floats(v, "v", 4)
        B, T, H, Hkv, D = self._attention_shape(qa, ka, va)
        out = np.empty_like(qa)
        lse = np.empty((B, H, T), dtype=np.float32)
        cdef int b = B, t_ = T, h = H, hkv = Hkv, d = D
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef float* pl = _fp(lse)
        cdef float* pq = _fp(qa)
        cdef float* pk = _fp(ka)
        cdef float* pv = _fp(va)
        with nogil:
            self._runner.attention_forward(po, pl, pq, pk, pv, b, t_, h, hkv, d, t)
        return out, lse

    def attention_backward(self, dout, out, lse, q, k, v, str dtype="fp32"):
        """(dq, dk, dv) of attention_forward; shapes as there (lse float32)."""
        qa = _op_floats(q, "q", 4)
        ka = _op_floats(k, "k", 4)
        va = _op_floats(v, "v", 4)
        B, T, H, Hkv, D = self._attention_shape(qa, ka, va)
        da = _op_floats(dout, "dout", 4)
        oa = _op_floats(out, "out", 4)
        la = _op_floats(lse, "lse", 3)
        _op_check_shape(da, qa.shape, "dout")
        _op_check_shape(oa, qa.shape, "out")
        _op_check_shape(la, (B, H, T), "lse")
        dq = np.empty_like(qa)
        dk = np.empty_like(ka)
        dv = np.empty_like(va)
        cdef int b = B, t_ = T, h = H, hkv = Hkv, d = D
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pdq = _fp(dq)
        cdef float* pdk = _fp(dk)
        cdef float* pdv = _fp(dv)
        cdef float* pd = _fp(da)
        cdef float* po = _fp(oa)
        cdef float* pl = _fp(la)
        cdef float* pq = _fp(qa)
        cdef float* pk = _fp(ka)
        cdef float* pv = _fp(va)
        with nogil:
            self._runner.attention_backward(pdq, pdk, pdv, pd, po, pl, pq, pk, pv, b, t_, h, hkv, d, t)
        return dq, dk, dv

    def swiglu_forward(self, gate, up, str dtype="fp32"):
        """silu(gate) * up, elementwise (same shapes)."""
        ga = _op_floats(gate, "gate")
        ua = _op_floats(up, "up")
        _op_check_shape(ua, ga.shape, "up")
        out = np.empty_like(ga)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* po = _fp(out)
        cdef float* pg = _fp(ga)
        cdef float* pu = _fp(ua)
        cdef int64_t n = ga.size
        with nogil:
            self._runner.swiglu_forward(po, pg, pu, n, t)
        return out

    def swiglu_backward(self, dout, gate, up, cbool alias=False, str dtype="fp32"):
        """(dgate, dup) of swiglu_forward. With alias, the op gets one device
        tensor as both dout and dgate."""
        da = _op_floats(dout, "dout")
        ga = _op_floats(gate, "gate")
        ua = _op_floats(up, "up")
        _op_check_shape(ga, da.shape, "gate")
        _op_check_shape(ua, da.shape, "up")
        dgate = np.empty_like(da)
        dup = np.empty_like(da)
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pdg = _fp(dgate)
        cdef float* pdu = _fp(dup)
        cdef float* pd = _fp(da)
        cdef float* pg = _fp(ga)
        cdef float* pu = _fp(ua)
        cdef int64_t n = da.size
        with nogil:
            self._runner.swiglu_backward(pdg, pdu, pd, pg, pu, n, alias, t)
        return dgate, dup

    def cross_entropy(self, logits, targets, stats=None, int first_position=0, time=None, float z_loss=0.0,
                      cbool with_grad=True, str dtype="fp32"):
        """(logits_out, stats) of the fused classifier on logits [rows, vocab]
        with targets [rows] (-100 = ignored). logits_out is the gradient of
        sum(CE + z_loss * lse^2) when with_grad (zero rows for ignored
        targets), else logits unchanged. stats [len(stat_slots)] float64 =
        `stats` (default zeros, lse_max -inf) plus this chunk's statistics;
        row r is at position (first_position + r) % time (time default: rows)."""
        res = _op_floats(logits, "logits", 2)
        cdef int rows = res.shape[0], vocab = res.shape[1]
        tg = _op_tokens(targets, "targets")
        _op_check_shape(tg, (rows,), "targets")
        slots = self.stat_slots
        if stats is None:
            st = np.zeros(len(slots), STAT_DTYPE)
            st[slots.index("lse_max")] = -np.inf
        else:
            st = _op_floats(stats, "stats", dtype=STAT_DTYPE)
            _op_check_shape(st, (len(slots),), "stats")
        cdef int time_ = rows if time is None else time
        cdef COpDType t = _op_dtype(dtype)
        cdef float* pr = _fp(res)
        cdef int32_t* pt = _ip(tg)
        cdef double* ps = _dp(st)
        with nogil:
            self._runner.cross_entropy(pr, pt, ps, rows, vocab, first_position, time_, z_loss, with_grad, t)
        return res, st

    def sum_squares(self, x, double initial=0.0):
        """initial + sum(x^2) over a float32 array, as a Python float (accumulated in float64)."""
        xa = _op_floats(x, "x")
        out = np.array([initial], dtype=STAT_DTYPE)
        cdef double* po = _dp(out)
        cdef float* px = _fp(xa)
        cdef int64_t n = xa.size
        with nogil:
            self._runner.sum_squares(po, px, n)
        return float(out[0])

    def optimizer_scale(self, gathered, float grad_clip):
        """[scale, grad_norm, skip] (float32) from gathered [ranks, gather_stride] float64."""
        ga = _op_floats(gathered, "gathered", 2, STAT_DTYPE)
        if ga.shape[1] != self.gather_stride:
            raise ValueError(f"gathered must have {self.gather_stride} columns, got shape {ga.shape}")
        out = np.empty(3, dtype=np.float32)
        cdef int ranks = ga.shape[0]
        cdef float* po = _fp(out)
        cdef double* pg = _dp(ga)
        with nogil:
            self._runner.optimizer_scale(po, pg, ranks, grad_clip)
        return out

    def adamw(self, param, grad, m, v, *, float lr, float scale=1.0, float beta1=0.9, float beta2=0.999,
              float eps=1e-8, float weight_decay=0.0, int step=1, uint64_t seed=0, str dtype="fp32",
              state_dtype=None):
        """(param, m, v) after one AdamW step with gradient grad * scale (all
        the same shape; grad float32). param's device dtype is dtype, m and
        v's state_dtype (default: dtype); bf16 values are stochastically
        rounded from seed."""
        pa = _op_floats(param, "param")
        ga = _op_floats(grad, "grad")
        ma = _op_floats(m, "m")
        va = _op_floats(v, "v")
        for arr, name in ((ga, "grad"), (ma, "m"), (va, "v")):
            _op_check_shape(arr, pa.shape, name)
        cdef COpDType t = _op_dtype(dtype)
        cdef COpDType st = _op_dtype(dtype if state_dtype is None else state_dtype)
        cdef float* pp = _fp(pa)
        cdef float* pg = _fp(ga)
        cdef float* pm = _fp(ma)
        cdef float* pv = _fp(va)
        cdef int64_t n = pa.size
        with nogil:
            self._runner.adamw(pp, pg, pm, pv, n, scale, lr, beta1, beta2, eps, weight_decay, step, seed, t, st)
        return pa, ma, va
