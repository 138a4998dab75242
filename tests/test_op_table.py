"""The op harness is driven by one table: the core's (op_table.cpp).

These tests pin what the table gives Python (methods, signatures, docs),
that the table covers the op interface, and the generic checks the harness
makes for every op (types, shapes, dtypes, aliasing, defaults). The ops'
numerics are tested in test_ops.py.
"""

import inspect
import pathlib
import re

import numpy as np
import pytest

from nanoq.testing import OpRunner, op_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Backend methods that move memory rather than compute: the harness uses
# them to stage every op, so they have no entry of their own.
STAGING = {"copy_from_host", "copy_from_staging", "copy_from_device", "copy_to_host"}
# Methods that announce state for later ops rather than compute: positions_changed
# (a batch's positions for the attention calls after it; the attention entries
# take their positions as an argument, and a call with positions not announced
# derives what it needs itself).
ANNOUNCEMENTS = {"positions_changed"}
FIXED_DTYPES = {"float32", "float64", "int32"}


@pytest.fixture(scope="module")
def cpu():
    return OpRunner("cpu")


def backend_ops():
    """The ops of the Backend interface: its methods taking a Tensor first."""
    text = (ROOT / "cuda_core" / "backend.h").read_text()
    return set(re.findall(r"virtual void (\w+)\(\s*const Tensor&", text)) - STAGING - ANNOUNCEMENTS


def test_every_op_of_the_backend_interface_has_a_table_entry():
    ops = backend_ops()
    assert {"matmul", "attention_backward", "adamw"} <= ops  # the pattern finds the interface
    missing = ops - set(op_table())
    assert not missing, f"ops of backend.h without an entry in cuda_core/op_harness/op_table.cpp: {sorted(missing)}"


def test_every_table_op_is_a_method_with_the_table_signature_and_doc():
    table = op_table()
    assert OpRunner.ops() == list(table)
    for name, spec in table.items():
        method = getattr(OpRunner, name)
        params = list(inspect.signature(method).parameters)
        assert params[0] == "self"
        expected = [a["name"] for a in spec["args"] if a["role"] != "output"]
        assert params[1:] == expected, name
        # Every device dtype that is not fixed is an argument of the call.
        for arg in spec["args"]:
            if arg["role"] in ("input", "in_out", "output") and arg["device_dtype"] not in FIXED_DTYPES:
                assert arg["device_dtype"] in params, (name, arg["name"])
        assert method.__doc__.startswith(spec["doc"]), name
        for arg in spec["args"]:
            assert f"    {arg['name']}: " in method.__doc__, (name, arg["name"])
        outputs = [a["name"] for a in spec["args"] if a["role"] in ("in_out", "output")]
        assert sorted(spec["results"]) == sorted(outputs), name


def test_defaults_come_from_the_table(cpu):
    params = inspect.signature(OpRunner.adamw).parameters
    assert params["beta2"].default == 0.999 and params["step"].default == 1
    assert params["state_dtype"].default is None  # the core uses dtype's value
    assert inspect.signature(OpRunner.rmsnorm_forward).parameters["eps"].default == 1e-6
    # Required arguments after optional ones are keyword-only.
    assert params["lr"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert inspect.signature(OpRunner.matmul).parameters["out_dtype"].default is None


def test_run_by_name_is_the_method(cpu):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
    assert np.array_equal(cpu.run("matmul", a, b, trans_b=False), cpu.matmul(a, b))
    np.testing.assert_allclose(cpu.run("matmul", a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_bad_calls_raise_type_and_value_errors_naming_the_argument(cpu):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        cpu.run("nope", x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
        cpu.add(x, x, c=x)
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        cpu.add(x)
    with pytest.raises(TypeError, match="fill: n must be an int"):
        cpu.fill(2.0, 1.0)
    with pytest.raises(TypeError, match="trans_a must be a bool"):
        cpu.matmul(x, x.T, trans_a=1)
    with pytest.raises(TypeError, match="tokens must be an integer array, got float32"):
        cpu.embedding_forward(np.zeros(3, np.float32), x)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        cpu.scale_dropout(x, 1.0, 0.5, -1)
    with pytest.raises(ValueError, match=r"add: b has shape \(3, 2\); expected \[\*n\] with leading dimensions "
                                         r"\(2, 3\) \(as a\)"):
        cpu.add(x, x.T)
    with pytest.raises(ValueError, match=r"add_bias: out has shape \(6,\); expected \[rows,cols\] \(2 dimensions\)"):
        cpu.add_bias(np.ones(6), np.ones(3))
    with pytest.raises(ValueError, match=r"a is empty"):
        cpu.add(np.ones((0, 3)), np.ones((0, 3)))
    with pytest.raises(ValueError, match=r"head_dim \(7\) must be divisible by 2"):
        cpu.rope_forward(np.ones((1, 2, 1, 7)), np.ones((2, 3, 2)))
    with pytest.raises(ValueError, match=r"step must be >= 1, got 0"):
        cpu.adamw(x, x, x, x, lr=1e-3, step=0)
    with pytest.raises(ValueError, match="drop must be in"):
        cpu.scale_dropout(x, 1.0, 1.0, 3)


def test_an_aliased_output_cannot_also_be_given(cpu):
    x, w = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    _, rstd = cpu.rmsnorm_forward(x, w)
    with pytest.raises(ValueError, match="dinp_accumulate_into cannot be given with alias=True"):
        cpu.rmsnorm_backward(x, x, w, rstd, dinp_accumulate_into=x, alias=True)


def test_results_take_the_shapes_of_the_inputs_star_groups(cpu):
    tokens = np.array([[[0, 1], [2, 0]]], np.int32)  # any leading shape
    out = cpu.embedding_forward(tokens, np.ones((3, 5), np.float32))
    assert out.shape == (1, 2, 2, 5) and out.dtype == np.float32
    out, rstd = cpu.rmsnorm_forward(np.ones((2, 3, 4)), np.ones(4))
    assert out.shape == (2, 3, 4) and rstd.shape == (6,)
    logits, stats = cpu.cross_entropy(np.zeros((2, 4)), [0, 1])
    assert stats.dtype == np.float64 and stats.shape == (len(cpu.stat_slots),)


def test_optional_in_outs_default_as_the_table_says(cpu):
    dout = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(cpu.bias_backward(dout), [3.0, 5.0, 7.0])  # dbias starts at zeros
    _, stats = cpu.cross_entropy(np.zeros((1, 4)), [-100])  # nothing counted: empty statistics
    lse_max = cpu.stat_slots.index("lse_max")
    assert stats[lse_max] == -np.inf and not stats[np.arange(len(stats)) != lse_max].any()
    assert cpu.sum_squares(np.full(4, 2.0))[0] == 16.0  # out starts at zero
