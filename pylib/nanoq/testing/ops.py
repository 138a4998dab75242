"""OpRunner: single backend ops on numpy arrays, for op-level tests.

Every method of OpRunner is made from the core's op table
(cuda_core/op_harness/op_table.cpp, exported by nanoq._ops): its name, its
arguments in the order of the table, their defaults and its docstring. A
call checks the Python types here; shapes, dtypes, token ranges and the
op's own rules are checked by the core, which raises ValueError naming the
argument. ``runner.run("matmul", a, b)`` is the same as ``runner.matmul(a, b)``.

Conventions, for every op:
- tensors are numpy arrays (anything np.asarray takes), converted to
  C-contiguous float32 (int32 tokens and targets, float64 statistics) and
  never modified;
- the op returns its results (the in/out tensors after the op, and the
  outputs) as new arrays, one array or a tuple in the table's order;
- an optional in/out left out (None) starts as zeros, as empty statistics,
  or is a plain output, as the table says (e.g. ``accumulate_into``);
- ``dtype`` ("fp32" or "bf16") is the device dtype of the activation and
  weight tensors (host values are rounded to bf16 on the device); tensors
  the interface keeps in float32 or float64 stay so;
- outputs start as NaN on the device, so an element the op never writes
  comes back NaN. Each call allocates its own device memory and blocks
  until the device is done.

``runner.time("matmul", a, b, repeats=20)`` times an op instead (for
bench/bench_ops.py): mean seconds of one run on the device.
"""

import inspect
import numbers

import numpy as np

from nanoq import _ops
from nanoq._ops import NativeOpRunner
from nanoq._ops import op_table as _native_op_table

_TENSOR_ROLES = ("input", "in_out", "output")


def op_table() -> dict:
    """{op name: dict(doc, args, results)}: the core's op table (see nanoq._ops.op_table)."""
    return _native_op_table()


def _default(arg):
    """The Python default of an optional argument: the table's value, or None
    (left out: the core fills it in)."""
    text, role = arg["default"], arg["role"]
    if arg["role"] in _TENSOR_ROLES or not text:
        return None
    if role in ("int", "seed"):
        return int(text)
    if role == "float":
        return float(text)
    if role == "bool":
        return text == "True"
    return text


def _signature(spec):
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    keyword_only = False
    for arg in spec["args"]:
        if arg["role"] == "output":
            continue
        if arg["required"]:
            kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            params.append(inspect.Parameter(arg["name"], kind))
        else:
            keyword_only = True  # a required argument after this one is keyword-only
            params.append(inspect.Parameter(arg["name"], inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            default=_default(arg)))
    # Keep the order valid: once a parameter is keyword-only, all after it are.
    fixed, seen_keyword_only = [], False
    for p in params:
        seen_keyword_only |= p.kind == inspect.Parameter.KEYWORD_ONLY
        if seen_keyword_only and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            p = p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        fixed.append(p)
    return inspect.Signature(fixed)


def _describe(arg):
    role = arg["role"]
    if role in _TENSOR_ROLES:
        dtype = arg["device_dtype"]
        what = f"{role.replace('_', '/')} [{arg['shape']}], {arg['host_dtype']} on the host"
        fixed = dtype in ("float32", "float64", "int32")
        what += f", device dtype {dtype}" if fixed else f", device dtype from {dtype}"
        if not arg["required"] and role != "output":
            what += " (optional)"
        return what
    if arg["default_from"]:
        return f"{role} (default: the value of {arg['default_from']})"
    return role + (f" (default {arg['default']})" if arg["default"] else "")


def _docstring(name, spec):
    lines = [spec["doc"] + ".", "", "Arguments:"]
    lines += [f"    {a['name']}: {_describe(a)}" for a in spec["args"]]
    lines += ["", "Returns: " + ", ".join(spec["results"])]
    return "\n".join(lines)


class _Spec:
    """One op of the table, ready to check and convert a call."""

    def __init__(self, name, spec):
        self.name = name
        self.doc = _docstring(name, spec)
        self.args = {a["name"]: a for a in spec["args"]}
        self.results = spec["results"]
        self.signature = _signature(spec)

    def convert(self, bound):
        tensors, scalars = {}, {}
        for name, value in bound.arguments.items():
            if name == "self" or value is None:
                continue
            arg = self.args[name]
            role = arg["role"]
            if role in _TENSOR_ROLES:
                tensors[name] = (self._array(name, value, arg["host_dtype"]), arg["host_dtype"])
            else:
                scalars[name] = (role, self._scalar(name, value, role))
        return tensors, scalars

    def _array(self, name, value, host_dtype):
        a = np.asarray(value)
        if host_dtype == "int32":
            if not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"{self.name}: {name} must be an integer array, got {a.dtype}")
            if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
                raise ValueError(f"{self.name}: {name} has values outside int32")
        elif not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise TypeError(f"{self.name}: {name} must be a numeric array, got {a.dtype}")
        return np.ascontiguousarray(a, dtype=host_dtype)

    def _scalar(self, name, value, role):
        if role == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{self.name}: {name} must be a bool, got {value!r}")
            return bool(value)
        if role == "dtype":
            if not isinstance(value, str):
                raise TypeError(f"{self.name}: {name} must be a str (\"fp32\" or \"bf16\"), got {value!r}")
            return value
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{self.name}: {name} must be a number, got {value!r}")
        if role == "float":
            if not isinstance(value, numbers.Real):
                raise TypeError(f"{self.name}: {name} must be a real number, got {value!r}")
            return float(value)
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{self.name}: {name} must be an int, got {value!r}")
        value = int(value)
        if role == "seed" and not 0 <= value < 2**64:
            raise ValueError(f"{self.name}: {name} must be an int in [0, 2**64), got {value}")
        if role == "int" and not -2**63 <= value < 2**63:
            raise ValueError(f"{self.name}: {name} = {value} does not fit int64")
        return value


_SPECS = {name: _Spec(name, spec) for name, spec in _native_op_table().items()}


class OpRunner:
    """Runs single ops of one backend ("cpu", "cuda", "cuda_emulated") on numpy arrays.

    For parity tests: feed two runners the same inputs and compare. The
    methods (one per op of the core's table) are listed by ``ops()``; the
    conventions they share are in this module's docstring.
    """

    def __init__(self, backend: str = "cpu", device: int = 0, threads: int = 0):
        if backend != "cpu":
            from nanoq.backends import device_count

            device_count(backend)  # checks the name; loads the backend's GPU libraries
        self._native = NativeOpRunner(backend, device, threads)
        self.backend = backend
        self.device = device

    @staticmethod
    def ops():
        """Names of the ops, in the table's order."""
        return list(_SPECS)

    @property
    def stat_slots(self):
        """Names of the cross_entropy statistics slots, in order (tuple of str)."""
        return _ops.stat_slots()

    @property
    def gather_stride(self):
        """Width of a row of optimizer_scale's `gathered`: the stat slots, then the sum of squares."""
        return _ops.gather_stride()

    def run(self, op: str, /, *args, **kwargs):
        """Runs op `op` with the arguments of its method (see ``ops()``)."""
        spec = _SPECS.get(op)
        if spec is None:
            raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(_SPECS)}")
        tensors, scalars = spec.convert(spec.signature.bind(self, *args, **kwargs))
        results = self._native.run(op, tensors, scalars)
        values = tuple(results[name] for name in spec.results)
        return values[0] if len(values) == 1 else values

    def time(self, op: str, /, *args, repeats: int = 10, **kwargs) -> float:
        """Mean seconds of one run of op `op` (arguments as for its method),
        for benchmarks: the call is staged once, the op runs once untimed
        (plans, autotuning), then ``repeats`` times back to back on the same
        device tensors (in/out tensors carry over from run to run), timed
        from an idle device to the device done. Returns only the time."""
        spec = _SPECS.get(op)
        if spec is None:
            raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(_SPECS)}")
        if isinstance(repeats, (bool, np.bool_)) or not isinstance(repeats, numbers.Integral) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        tensors, scalars = spec.convert(spec.signature.bind(self, *args, **kwargs))
        return self._native.time(op, tensors, scalars, int(repeats))


def _method(spec):
    def method(self, *args, **kwargs):
        return self.run(spec.name, *args, **kwargs)

    method.__name__ = spec.name
    method.__qualname__ = f"OpRunner.{spec.name}"
    method.__doc__ = spec.doc
    method.__signature__ = spec.signature
    return method


for _name, _spec in _SPECS.items():
    if hasattr(OpRunner, _name):
        raise RuntimeError(f"op {_name!r} of the core's table clashes with an OpRunner attribute")
    setattr(OpRunner, _name, _method(_spec))
del _name, _spec
