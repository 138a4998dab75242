# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Binding over the core's public header (cuda_core/include/nanoq/trainer.h).

Arrays are checked here (dtype, shape, contiguity) before any pointer reaches
C++; token values are checked by the Python layer (nanoq.trainer). Every call
into the core releases the GIL.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
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

cdef extern from "nanoq/transport.h" namespace "nanoq" nogil:
    cdef cppclass CProcessTransport "nanoq::ProcessTransport":
        pass
    double core_collective_timeout "nanoq::collective_timeout_seconds"() except +nanoq_raise_py_error
    string core_collective_timeout_advice "nanoq::collective_timeout_advice"() except +nanoq_raise_py_error

cdef extern from "py_transport.h":
    cdef cppclass CPyTransport "NanoqPyTransport"(CProcessTransport):
        CPyTransport(object, int, int)


cdef extern from "nanoq/testing_hooks.h" namespace "nanoq" nogil:
    cdef cppclass CTestingHookInfo "nanoq::TestingHookInfo":
        string name, doc
        int64_t disarmed

    cdef cppclass CTestingHooks "nanoq::TestingHooks":
        @staticmethod
        vector[CTestingHookInfo] info()
        void arm(const string&, int64_t) except +nanoq_raise_py_error


cdef extern from "stat_slots.h" namespace "nanoq" nogil:
    const int kIgnoreIndex

# A target the loss skips (PyTorch's ignore_index): the core's.
IGNORE_INDEX = kIgnoreIndex


cdef extern from "nanoq/options.h" namespace "nanoq" nogil:
    cdef cppclass CPrecision "nanoq::Precision":
        pass

    cdef cppclass CAttentionImpl "nanoq::AttentionImpl":
        pass

    cdef cppclass CMatmulPrecision "nanoq::MatmulPrecision":
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
    CAttentionImpl attention_named(const string&) except +nanoq_raise_py_error
    CMatmulPrecision matmul_dtype_named(const string&) except +nanoq_raise_py_error
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
        cbool tie_embeddings, qkv_bias, o_bias, qk_norm, causal
        int max_positions
        cbool mlp_bias
        float dropout

    cdef cppclass CCommEvent "nanoq::CommEvent":
        string what
        int layer
        int64_t ticket

    cdef cppclass CAttentionInfo "nanoq::AttentionInfo":
        string implementation
        int plans
        string documents
        int64_t document_masks
        cbool deterministic

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
        int world_size, first_rank, first_device
        string comm_id
        CAttentionImpl attention
        cbool attention_deterministic
        cbool cuda_graphs
        CMatmulPrecision matmul_dtype
        cbool packed_documents
        cbool inference

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
        vector[CAllocationInfo] generation
        int classifier_rows

    cdef cppclass CMemoryInfo "nanoq::MemoryInfo":
        size_t allocated, limit, free, total
        cbool known

    cdef cppclass CStackInfo "nanoq::StackInfo":
        size_t capacity, high_water
        vector[pair[string, size_t]] live_at_high_water

    cdef cppclass CTrainer "nanoq::Trainer":
        CTrainer(const CModelConfig&, const CTrainOptions&, shared_ptr[CProcessTransport]) \
            except +nanoq_raise_py_error
        int world_size()
        int devices()
        int first_rank()
        vector[CParameterInfo] parameters()
        void set_parameter(int, const float*) except +nanoq_raise_py_error
        void get_parameter(int, float*) except +nanoq_raise_py_error
        void get_gradient(int, float*) except +nanoq_raise_py_error
        void get_gradient_addend(int, float*) except +nanoq_raise_py_error
        void get_optimizer_state(int, int, float*) except +nanoq_raise_py_error
        void set_optimizer_state(int, int, const float*) except +nanoq_raise_py_error
        void set_optimizer_steps(int) except +nanoq_raise_py_error
        pair[int64_t, int64_t] owned_range(int) except +nanoq_raise_py_error
        void get_parameter_part(int, float*) except +nanoq_raise_py_error
        void get_optimizer_state_part(int, int, float*) except +nanoq_raise_py_error
        void set_optimizer_state_part(int, int, const float*) except +nanoq_raise_py_error
        void step(const int32_t*, const int32_t*, int, uintptr_t, uintptr_t,
                  const int32_t*) except +nanoq_raise_py_error
        CStepStats validate(const int32_t*, const int32_t*, int, uintptr_t, uintptr_t,
                            const int32_t*) except +nanoq_raise_py_error
        void queue_validate(const int32_t*, const int32_t*, int, uintptr_t, uintptr_t, const int32_t*) \
            except +nanoq_raise_py_error
        CStepStats validate_result() except +nanoq_raise_py_error
        CStepStats update(const CUpdateParams&) except +nanoq_raise_py_error
        void forward_cached(const int32_t*, int, int, cbool, float*) except +nanoq_raise_py_error
        void wait() except +nanoq_raise_py_error
        cbool wait_ready(int, cbool) except +nanoq_raise_py_error
        void discard_micro_batches() except +nanoq_raise_py_error
        int micro_steps()
        int optimizer_steps()
        vector[CAllocationInfo] allocations(int) except +nanoq_raise_py_error
        CStackInfo stack_info(int) except +nanoq_raise_py_error
        CMemoryInfo memory_info(int) except +nanoq_raise_py_error
        CTestingHooks& testing_hooks()
        vector[CCommEvent] communication_trace(int) except +nanoq_raise_py_error
        CAttentionInfo attention_info(int) except +nanoq_raise_py_error


    vector[CDevicePlan] core_plan_memory "nanoq::plan_memory"(const CModelConfig&, const CTrainOptions&,
                                                              cbool, size_t) except +nanoq_raise_py_error
    vector[CParameterInfo] core_parameter_layout "nanoq::parameter_layout"(const CModelConfig&) \
        except +nanoq_raise_py_error
    cbool has_backend(const string&)
    string core_new_comm_id "nanoq::new_comm_id"(const string&) except +nanoq_raise_py_error
    int backend_device_count(const string&) except +nanoq_raise_py_error
    string backend_attention_library(const string&) except +nanoq_raise_py_error

    cdef cppclass CCpuGemm "nanoq::CpuGemm":
        string name
        cbool openblas_built
    CCpuGemm core_cpu_gemm "nanoq::cpu_gemm"() except +nanoq_raise_py_error

    cdef cppclass CHostMemory "nanoq::HostMemory":
        size_t bytes
        string source
    CHostMemory core_cpu_host_memory "nanoq::cpu_host_memory"() except +nanoq_raise_py_error
    size_t core_cgroup_memory_available "nanoq::cgroup_memory_available"(const string&, const string&) \
        except +nanoq_raise_py_error


def backend_built(str name):
    """Whether backend `name` ("cpu", "cuda") is compiled into this install (no loading)."""
    return has_backend(name.encode())


def new_comm_id(str name):
    """A fresh communicator id (bytes) of backend `name`, for TrainOptions.comm_id."""
    return <bytes>core_new_comm_id(name.encode())


def collective_timeout():
    """Seconds a wait on the other ranks of a world may last before it gives
    up with an error (NANOQ_COLLECTIVE_TIMEOUT; 1800 by default; 0: no
    limit); ValueError for a value that is not a number of seconds >= 0."""
    return core_collective_timeout()


def collective_timeout_advice():
    """The end of that error's message: what may have happened, and the variable."""
    return core_collective_timeout_advice().decode()


def device_count(str name):
    """Devices backend `name` can use now. Loads its library: raises ValueError
    if it is not built, NanoqError if it cannot be loaded."""
    cdef string n = name.encode()
    cdef int count
    with nogil:
        count = backend_device_count(n)
    return count


def attention_library(str name):
    """The fused attention library backend `name` was built with ("cuDNN
    9.28.1"), or "" for none. Loads its library (errors as device_count)."""
    cdef string n = name.encode()
    cdef string library
    with nogil:
        library = backend_attention_library(n)
    return library.decode()


def cpu_gemm():
    """The sgemm a cpu backend created now runs, as dict(name="openblas" or
    "portable", openblas_built=bool). NANOQ_CPU_GEMM ("portable", "openblas")
    overrides the default (OpenBLAS when this build has it); ValueError for
    a value this build cannot honour."""
    cdef CCpuGemm gemm = core_cpu_gemm()
    return dict(name=gemm.name.decode(), openblas_built=gemm.openblas_built)


def cpu_host_memory():
    """The host memory the cpu backend's trainers may hold together, as
    (bytes, source): what the machine has available (MemAvailable within
    the cgroup's limit, or NANOQ_CPU_MEMORY_AVAILABLE) plus what they hold
    already; bytes 0 where the machine does not say. ValueError for a bad
    NANOQ_CPU_MEMORY_AVAILABLE."""
    cdef CHostMemory memory = core_cpu_host_memory()
    return memory.bytes, memory.source.decode()


def cgroup_memory_available(str self_cgroup, str cgroup_root):
    """What the memory cgroups named in `self_cgroup` (a file in
    /proc/self/cgroup's format) leave under `cgroup_root`, in bytes; None
    where none sets a limit (see cpu_host_memory; for tests)."""
    cdef size_t left = core_cgroup_memory_available(self_cgroup.encode(), cgroup_root.encode())
    return None if left == <size_t>-1 else left


# What CoreTrainer._read copies out; 0..2 are the core's optimizer state kinds.
cdef enum:
    _WEIGHTS = -1
    _GRADIENTS = -2
    _GRADIENT_ADDEND = -3


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
    c.max_positions = config["max_position_embeddings"] if config["position_embedding"] == "learned" else 0
    c.mlp_bias = config["mlp_bias"]
    c.dropout = config["dropout"]
    c.causal = config.get("causal", True)
    return c


def plan_memory(dict config, dict options, cbool ask_libraries=True, device_memory=0):
    """What CoreTrainer(config, options) would allocate, per device, computed
    by the core without a device (nanoq::plan_memory): a list with one dict
    per device, allocations (dicts context, name, bytes, kind, exact, in
    allocation order), stack_capacity, generation: the allocations (same
    dicts) that the trainer's first generation adds, its KV cache, and
    classifier_rows: the rows of its classifier's logits chunk. Devices
    whose allocation lists are equal share one list object. device_memory
    (bytes, 0 = none): plan each device as one of that size (on cuda, the
    classifier chunk grows into it as on such a GPU). Raises as the Trainer
    does for bad options, and OutOfMemoryError where memory_limit would be
    exceeded (the KV cache is planned without it)."""
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or \
            not 0 <= device_memory < 2**64:
        raise ValueError(f"device_memory must be a byte count (an integer >= 0), got {device_memory!r}")
    cdef CModelConfig c = _model_config(config)
    cdef CTrainOptions o = _core_options(options)
    cdef size_t memory = device_memory
    cdef vector[CDevicePlan] plans
    with nogil:
        plans = core_plan_memory(c, o, ask_libraries, memory)
    out = []
    cdef size_t device
    for device in range(plans.size()):
        if device and _same_allocations(plans[device].allocations, plans[device - 1].allocations):
            allocations = out[device - 1]["allocations"]
        else:
            allocations = _allocation_dicts(plans[device].allocations)
        out.append(dict(allocations=allocations, stack_capacity=plans[device].stack_capacity,
                        generation=_allocation_dicts(plans[device].generation),
                        classifier_rows=plans[device].classifier_rows))
    return out


cdef list _allocation_dicts(const vector[CAllocationInfo]& allocations):
    out = []
    cdef size_t i
    for i in range(allocations.size()):
        out.append(dict(context=allocations[i].context.decode(), name=allocations[i].name.decode(),
                        bytes=allocations[i].bytes, kind=allocations[i].kind.decode(), exact=allocations[i].exact))
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


cdef int _c_int(str name, object value) except? -1:
    """`value` as the C int of integer option `name`: a ValueError naming
    the option, with the core's limits, when it does not fit one."""
    try:
        return value
    except OverflowError:
        low, high = _SCHEMA_LIMITS[name]
        raise ValueError(f"{name} must be an integer in [{low:g}, {high:g}], got {value!r}") from None


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
            o.devices = _c_int(key, value)
        elif key == "batch_size":
            o.batch_size = _c_int(key, value)
        elif key == "seq_len":
            o.seq_len = _c_int(key, value)
        elif key == "grad_accum":
            o.grad_accum = _c_int(key, value)
        elif key == "threads":
            o.threads = _c_int(key, value)
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
            o.zero_stage = _c_int(key, value)
        elif key == "world_size":
            o.world_size = _c_int(key, value)
        elif key == "first_rank":
            o.first_rank = _c_int(key, value)
        elif key == "first_device":
            o.first_device = _c_int(key, value)
        elif key == "comm_id":
            o.comm_id = value
        elif key == "attention":
            o.attention = attention_named(value.encode())
        elif key == "attention_deterministic":
            o.attention_deterministic = value
        elif key == "cuda_graphs":
            o.cuda_graphs = value
        elif key == "packed_documents":
            o.packed_documents = value
        elif key == "inference":
            o.inference = value
        elif key == "matmul_dtype":
            o.matmul_dtype = matmul_dtype_named(value.encode())
        elif key == "lora":
            if value:
                o.lora_rank = _c_int("lora_rank", value["rank"])
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
    "number", "flag"), help, choices=[dict(name, help, implies=[names])], minimum,
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
# (minimum, maximum) of each integer option, for _c_int's message.
_SCHEMA_LIMITS = {spec["name"]: tuple(limit["value"] if limit else bound for limit, bound in
                                      ((spec["minimum"], -2.0 ** 31), (spec["maximum"], 2.0 ** 31 - 1)))
                  for spec in _SCHEMA["options"] if spec["kind"] == "integer"}


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
    cdef readonly int vocab_size

    def __cinit__(self, dict config, dict options, transport=None):
        """transport: None, or an object with rank, size, alltoallv(send,
        send_counts, recv, recv_counts) and barrier() (nanoq.distributed.MPITransport)
        reaching the other processes of the world."""
        cdef CModelConfig c = _model_config(config)
        cdef CTrainOptions o = _core_options(options)
        cdef shared_ptr[CProcessTransport] t
        if transport is not None:
            t.reset(<CProcessTransport*>new CPyTransport(transport, int(transport.rank), int(transport.size)))
        self.batch_rows = o.devices * o.batch_size
        self.seq_len = o.seq_len
        self.vocab_size = c.vocab_size
        with nogil:
            self._trainer = new CTrainer(c, o, t)

    def __dealloc__(self):
        self.close()

    def close(self):
        cdef CTrainer* trainer = self._trainer
        self._trainer = NULL
        if trainer != NULL:
            with nogil:
                del trainer

    def wait(self):
        """Waits for the queued steps; raises the error of a failed one (a
        closed trainer has nothing to wait for)."""
        cdef CTrainer* t = self._trainer
        if t == NULL:
            return
        with nogil:
            t.wait()

    def wait_ready(self, int milliseconds, cbool for_step):
        """Whether what the next call waits for first (the queued steps; for
        a step, its batch slot) is done, after waiting at most
        ``milliseconds`` for it. Raises nothing of the queued work: the next
        call does. A closed trainer is always ready."""
        cdef CTrainer* t = self._trainer
        cdef cbool done
        if t == NULL:
            return True
        with nogil:
            done = t.wait_ready(milliseconds, for_step)
        return done

    def discard_micro_batches(self):
        """After an interrupt: the micro-batches since the last update are
        discarded (see nanoq::Trainer::discard_micro_batches); returns at once."""
        cdef CTrainer* t = self._trainer
        if t == NULL:
            return
        with nogil:
            t.discard_micro_batches()

    cdef CTrainer* _get(self) except NULL:
        if self._trainer == NULL:
            raise RuntimeError("this Trainer is closed")
        return self._trainer

    @property
    def world_size(self):
        """This trainer's devices (the Python API's world_size)."""
        return self._get().devices()

    @property
    def world(self):
        """Ranks in the whole world: this trainer's devices and other trainers'."""
        return self._get().world_size()

    @property
    def first_rank(self):
        return self._get().first_rank()

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

    def get_gradient_addend(self, int index):
        """This trainer's addend of the world's gradient (full shape); collective."""
        return self._read(index, _GRADIENT_ADDEND)

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

    def owned_range(self, int index):
        """(begin, end): the elements of trainable parameter ``index``
        (flattened) in the shards of this trainer's devices."""
        cdef CTrainer* t = self._get()
        self._check_index(index)
        cdef pair[int64_t, int64_t] r = t.owned_range(index)
        return int(r.first), int(r.second)

    def get_parameter_part(self, int index):
        """This trainer's part (owned_range) of a trainable parameter's
        weights: float32 [end - begin]."""
        return self._read_part(index, _WEIGHTS)

    def get_optimizer_state_part(self, int index, int kind):
        """This trainer's part (owned_range) of optimizer state ``kind`` (0
        master weights, 1 AdamW m, 2 AdamW v): float32 [end - begin]."""
        if kind not in (0, 1, 2):
            raise ValueError(f"optimizer state kind must be 0, 1 or 2, got {kind}")
        return self._read_part(index, kind)

    def set_optimizer_state_part(self, int index, int kind, const float[::1] data):
        """Writes this trainer's part (owned_range) of optimizer state ``kind``."""
        if kind not in (0, 1, 2):
            raise ValueError(f"optimizer state kind must be 0, 1 or 2, got {kind}")
        begin, end = self.owned_range(index)
        if data.shape[0] != end - begin:
            raise ValueError(f"this trainer's part of parameter {index} has {end - begin} elements "
                             f"([{begin}, {end})), got {data.shape[0]}")
        if end == begin:
            return
        cdef CTrainer* t = self._get()
        with nogil:
            t.set_optimizer_state_part(index, kind, &data[0])

    cdef _read_part(self, int index, int what):
        begin, end = self.owned_range(index)
        out = np.empty(end - begin, dtype=np.float32)
        if end == begin:
            return out
        cdef CTrainer* t = self._get()
        cdef float[::1] view = out
        with nogil:
            if what == _WEIGHTS:
                t.get_parameter_part(index, &view[0])
            else:
                t.get_optimizer_state_part(index, what, &view[0])
        return out

    def _check_index(self, int index):
        if index < 0 or index >= <int>self._get().parameters().size():
            raise ValueError(f"parameter index {index} out of range")

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
            elif what == _GRADIENT_ADDEND:
                t.get_gradient_addend(index, &view[0])
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

    cdef const int32_t* _positions(self, const int32_t[:, ::1] positions) except? NULL:
        # A host batch's positions (None: none); the core checks their values.
        if positions is None:
            return NULL
        self._check_batch_shape(positions.shape[0], positions.shape[1])
        return &positions[0, 0]

    def step(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets,
             const int32_t[:, ::1] positions=None):
        """Host (numpy) batch: int32 C-contiguous [devices*batch_size, seq_len];
        positions (optional, host) the same shape."""
        cdef CTrainer* t = self._get()
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            t.step(&inputs[0, 0], &targets[0, 0], -1, 0, 0, p)

    def validate(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets,
                 const int32_t[:, ::1] positions=None):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            s = t.validate(&inputs[0, 0], &targets[0, 0], -1, 0, 0, p)
        return _stats_dict(s)

    def queue_validate(self, const int32_t[:, ::1] inputs, const int32_t[:, ::1] targets,
                       const int32_t[:, ::1] positions=None):
        """validate()'s first half (host batch): queues it and returns; the
        caller keeps the arrays alive and unchanged until the work has run
        (positions are copied at once)."""
        cdef CTrainer* t = self._get()
        self._check_batch_shape(inputs.shape[0], inputs.shape[1])
        self._check_batch_shape(targets.shape[0], targets.shape[1])
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            t.queue_validate(&inputs[0, 0], &targets[0, 0], -1, 0, 0, p)

    def queue_validate_device(self, uintptr_t inputs, uintptr_t targets, int device, uintptr_t inputs_stream=0,
                              uintptr_t targets_stream=0, const int32_t[:, ::1] positions=None):
        """validate()'s first half for a device batch (as step_device)."""
        cdef CTrainer* t = self._get()
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            t.queue_validate(<const int32_t*>inputs, <const int32_t*>targets, device, inputs_stream,
                             targets_stream, p)

    def validate_result(self):
        """validate()'s second half: waits for the queued validate; its statistics."""
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        with nogil:
            s = t.validate_result()
        return _stats_dict(s)

    def step_device(self, uintptr_t inputs, uintptr_t targets, int device, uintptr_t inputs_stream=0,
                    uintptr_t targets_stream=0, const int32_t[:, ::1] positions=None):
        """Device batch: pointers to int32 C-contiguous [devices*batch_size,
        seq_len] arrays in the memory of `device` (checked by the caller),
        and the streams they are written on, as the CUDA Array Interface v3
        names them (0: none); the step's reads wait for those streams.
        positions (optional) is a host array."""
        cdef CTrainer* t = self._get()
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            t.step(<const int32_t*>inputs, <const int32_t*>targets, device, inputs_stream, targets_stream, p)

    def validate_device(self, uintptr_t inputs, uintptr_t targets, int device, uintptr_t inputs_stream=0,
                        uintptr_t targets_stream=0, const int32_t[:, ::1] positions=None):
        cdef CTrainer* t = self._get()
        cdef CStepStats s
        cdef const int32_t* p = self._positions(positions)
        with nogil:
            s = t.validate(<const int32_t*>inputs, <const int32_t*>targets, device, inputs_stream, targets_stream,
                           p)
        return _stats_dict(s)

    def forward_cached(self, const int32_t[::1] tokens, int position, cbool all_positions, float[::1] logits not None):
        """Tokens int32 [count] through the model with the KV cache at
        `position` (0: a prompt; else one token after the cached ones);
        logits float32 [count * vocab] (all_positions) or [vocab] is written."""
        cdef CTrainer* t = self._get()
        cdef int count = tokens.shape[0]
        if count < 1:
            raise ValueError("forward_cached needs at least one token")
        if logits.shape[0] < 1:
            raise ValueError("logits is empty")
        cdef Py_ssize_t vocab = self.vocab_size
        cdef Py_ssize_t needed = vocab * (count if all_positions else 1)
        if logits.shape[0] != needed:
            raise ValueError(f"logits has {logits.shape[0]} elements, forward_cached writes {needed}")
        with nogil:
            t.forward_cached(&tokens[0], count, position, all_positions, &logits[0])

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
        cdef vector[CAllocationInfo] found
        # Without the GIL: it waits for the queued steps, whose exchanges between processes need it.
        with nogil:
            found = t.allocations(device)
        return [dict(context=a.context.decode(), name=a.name.decode(), bytes=a.bytes, kind=a.kind.decode())
                for a in found]

    def stack_info(self, int device):
        cdef CTrainer* t = self._get()
        cdef CStackInfo s
        with nogil:  # (as allocations)
            s = t.stack_info(device)
        return dict(capacity=s.capacity, high_water=s.high_water,
                    live_at_high_water=[(e.first.decode(), e.second) for e in s.live_at_high_water])

    def memory_info(self, int device):
        cdef CTrainer* t = self._get()
        cdef CMemoryInfo m
        with nogil:
            m = t.memory_info(device)
        return dict(allocated=m.allocated, limit=m.limit, free=m.free if m.known else None,
                    total=m.total if m.known else None)

    def arm_testing_hook(self, str name, int64_t value):
        """Arms the core's testing hook `name` (see nanoq.testing; never product code)."""
        self._get().testing_hooks().arm(name.encode(), value)

    def communication_trace(self, int device):
        """What `device` recorded while the "trace_communication" hook was armed (see nanoq.testing)."""
        cdef CTrainer* t = self._get()
        cdef vector[CCommEvent] events
        with nogil:
            events = t.communication_trace(device)
        return [(e.what.decode(), e.layer, e.ticket) for e in events]

    def attention_info(self, int device):
        """dict(implementation, plans, documents, document_masks, deterministic) of `device`
        (Trainer.get_attention_info)."""
        cdef CTrainer* t = self._get()
        cdef CAttentionInfo info
        with nogil:
            info = t.attention_info(device)
        return dict(implementation=info.implementation.decode(), plans=info.plans, documents=info.documents.decode(),
                    document_masks=info.document_masks, deterministic=info.deterministic)


def testing_hooks():
    """[(name, disarmed value, doc)] of the core's testing hooks (nanoq/testing_hooks.h)."""
    return [(h.name.decode(), h.disarmed, h.doc.decode()) for h in CTestingHooks.info()]
