"""Fuzz tests (hypothesis): every parser and the Trainer API either works or
raises one of its documented exceptions, whatever it is given.

Documented exceptions, per entry point:

- ``Trainer.step/validate/update/get_gradients/...``: TypeError or ValueError
  before the core; RuntimeError after ``close()``; FileNotFoundError or
  CheckpointError (a ValueError) for missing files.
- ``TokenFile``: ValueError (or FileNotFoundError); the tokens and mask read
  back equal what an independent decoder of the format finds.
- ``read_safetensors``: ValueError; the data regions of an accepted file tile
  its data buffer exactly (no overlaps, no holes), as the safetensors spec asks.
- ``ModelConfig.from_hf_dict`` / ``from_pretrained``: ValueError naming the source.
- ``read_state``: CheckpointError naming the checkpoint.
- ``load_config`` / ``TrainConfig.from_dict``: ValueError naming the file or key.
- text/JSONL/SFT readers and the Nano importer: InputError (a ValueError)
  naming ``file:line``; a pickle that names a function is never run.

Runs are deterministic (derandomize=True) and bounded: the example counts keep
the whole file within about 15 s on two CPU cores. The number of examples run
per parser is printed when the module finishes.
"""

import base64
import collections
import json
import math
import os
import pickle
import re
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

import nanoq
from nanoq.checkpoint import CheckpointError, part_file_name, read_state, state_checksum
from nanoq.data import TokenFile, write_tokens
from nanoq.hf_io import read_safetensors
from nanoq.tokenization import InputError, import_nano, read_documents
from nanoq.tokenization.nano import read_nano_lines
from nanoq.training.settings import SECTIONS, TrainConfig, load_config, settings as config_settings

# Examples run per parser, printed when the module ends.
EXAMPLES = collections.Counter()
# Random float64/int values cast to narrower dtypes overflow to inf, as they should.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def fuzz(examples):
    """Deterministic, time-bounded hypothesis settings."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def report_examples(request):
    yield
    line = "fuzz examples per parser: " + ", ".join(f"{name} {count}" for name, count in sorted(EXAMPLES.items()))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print("\n" + line)


def peak_allocation(call):
    """(result or exception, peak bytes Python and numpy allocated during call())."""
    tracemalloc.start()
    try:
        try:
            outcome = call()
        except Exception as e:  # noqa: BLE001 - returned for the caller to judge
            outcome = e
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
int32s = st.integers(INT32_MIN, INT32_MAX)
# Any JSON value, with the numbers parsers trip on.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 10**400, -(10**400), 1e308, 0.5, "", "silu"])
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)


# --------------------------------------------------------------------------
# Trainer API
# --------------------------------------------------------------------------

VOCAB, ROWS, SEQ, ACCUM = 64, 2, 8, 2
CONFIG = nanoq.ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
OPTIONS = nanoq.TrainOptions(backend="cpu", devices=1, batch_size=ROWS, seq_len=SEQ, grad_accum=ACCUM, threads=1)
_rng = np.random.default_rng(7)
GOOD = (_rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32), _rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32))


def pending(trainer):
    """Micro-batches accumulated since the last update (no public accessor)."""
    return trainer._core.micro_steps


def assert_still_trains(trainer):
    """A valid step + update works and gives a finite loss over every token."""
    if pending(trainer):
        trainer.update(lr=0.0)
    trainer.init_weights(0)
    trainer.step(*GOOD)
    stats = trainer.update(lr=1e-3)
    assert math.isfinite(stats.loss) and stats.tokens == ROWS * SEQ


@pytest.fixture
def trainer():
    """One tiny trainer per test function, shared by all its examples; it
    must still train once the fuzzing is over."""
    with nanoq.Trainer(CONFIG, OPTIONS) as tr:
        yield tr
        assert_still_trains(tr)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny model: (root, step directory)."""
    root = tmp_path_factory.mktemp("fuzz-checkpoint")
    with nanoq.Trainer(CONFIG, OPTIONS) as tr:
        tr.step(*GOOD)
        tr.update(lr=1e-3)
        return str(root), tr.save_checkpoint(root, 1)


@pytest.fixture(scope="module")
def exported_weights(tmp_path_factory):
    """The tiny model's weights as a Hugging Face model.safetensors."""
    with nanoq.Trainer(CONFIG, OPTIONS) as tr:
        return os.path.join(tr.export_model(tmp_path_factory.mktemp("fuzz-model") / "model"), "model.safetensors")


NUMPY_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                np.float16, np.float32, np.float64, np.bool_]
SPECIAL_TOKENS = [0, VOCAB - 1, VOCAB, -1, -100, INT32_MIN, INT32_MAX]


def _layout(array, layout):
    """The same values in another memory layout."""
    if array.ndim == 0 or layout == "c":
        return np.ascontiguousarray(array)
    if layout == "fortran":
        return np.asfortranarray(array)
    if layout == "reversed":  # negative strides
        return np.ascontiguousarray(array[::-1])[::-1]
    if layout == "transposed":
        return np.ascontiguousarray(array.T).T
    wide = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)  # "step2": every other element
    wide[..., ::2] = array
    return wide[..., ::2]


@st.composite
def token_arrays(draw):
    dtype = draw(st.one_of(st.just(np.int32), st.sampled_from(NUMPY_DTYPES)))
    shape = draw(st.one_of(
        st.just((ROWS, SEQ)),
        st.sampled_from([(0,), (0, SEQ), (ROWS, 0), (ROWS * SEQ,), (ROWS, SEQ, 1), (ROWS + 1, SEQ), (ROWS, SEQ + 1),
                         (SEQ, ROWS), ()]),
        npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
    values = draw(npst.arrays(np.int64, shape, elements=st.integers(0, VOCAB - 1)))
    flat = values.reshape(-1)
    for index, token in draw(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL_TOKENS)),
                                      max_size=3)):
        if flat.size:
            flat[index % flat.size] = token
    return _layout(values.astype(dtype), draw(st.sampled_from(["c", "fortran", "reversed", "transposed", "step2"])))


valid_token_arrays = npst.arrays(np.int32, (ROWS, SEQ), elements=st.integers(0, VOCAB - 1))
batch_arguments = st.one_of(
    valid_token_arrays, valid_token_arrays, token_arrays(), token_arrays(),
    st.none(), st.integers(), st.text(max_size=4),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=SEQ, max_size=SEQ), min_size=ROWS, max_size=ROWS))


def valid_batch(array, allow_ignore):
    if not (isinstance(array, np.ndarray) and array.dtype == np.int32 and array.shape == (ROWS, SEQ)
            and array.flags.c_contiguous):
        return False
    ok = (array >= 0) & (array < VOCAB)
    if allow_ignore:
        ok |= array == -100
    return bool(ok.all())


@fuzz(150)
@given(inputs=batch_arguments, targets=batch_arguments, call=st.sampled_from(["step", "validate"]))
def test_fuzz_step_and_validate_arguments(trainer, inputs, targets, call):
    """Exactly the int32 C-contiguous [rows, seq] batches with ids in range
    (and -100 in targets) are accepted; a rejected call counts nothing."""
    EXAMPLES["Trainer.step/validate"] += 1
    if pending(trainer) == ACCUM:
        trainer.update(lr=1e-3)
    expected = valid_batch(inputs, allow_ignore=False) and valid_batch(targets, allow_ignore=True)
    before = pending(trainer)
    try:
        result = getattr(trainer, call)(inputs, targets)
    except (TypeError, ValueError) as e:
        assert not expected, f"a valid batch was rejected: {e}"
        assert pending(trainer) == before
        return
    assert expected, "an invalid batch was accepted"
    if call == "step":
        assert pending(trainer) == before + 1
    else:
        assert result.tokens == int((targets != -100).sum())
        assert math.isfinite(result.loss) or result.tokens == 0


HYPER_RANGES = {  # name: (low, high, low inclusive, high inclusive)
    "lr": (0.0, math.inf, True, True),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "weight_decay": (0.0, math.inf, True, True),
    "grad_clip": (0.0, math.inf, True, True),
    "eps": (float(np.finfo(np.float32).tiny), math.inf, True, True),  # a float32 normal: subnormals flush to 0
}
hyper_values = st.one_of(
    st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True), st.floats(), st.integers(-5, 5),
    st.sampled_from([10**400, -(10**400), 2**63, 2**64, 1e308, True, False, None, "0.1", [0.1], 1j,
                     np.float32(0.5), np.float64("nan"), np.float16(0.1), np.int64(1), np.uint8(0), np.bool_(True)]))


def valid_hyper(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        value = float(value)
    except OverflowError:
        return False
    low, high, low_inclusive, high_inclusive = HYPER_RANGES[name]
    with np.errstate(over="ignore"):
        single = float(np.float32(value))  # the core computes in float32: both must hold
    return all(math.isfinite(x) and (x >= low if low_inclusive else x > low) and
               (x <= high if high_inclusive else x < high) for x in (value, single))


@fuzz(120)
@given(hyper=st.fixed_dictionaries({"lr": hyper_values},
                                   optional={name: hyper_values for name in HYPER_RANGES if name != "lr"}),
       step_first=st.booleans())
def test_fuzz_update_hyper_parameters(trainer, hyper, step_first):
    """update() applies finite, in-range numbers and rejects anything else
    (NaN, inf, out of range, bools, strings, ints too big for a float) with
    TypeError/ValueError, keeping the accumulated gradients."""
    EXAMPLES["Trainer.update"] += 1
    if step_first and pending(trainer) < ACCUM:
        trainer.step(*GOOD)
    before = pending(trainer)
    valid = all(valid_hyper(name, value) for name, value in hyper.items())
    try:
        stats = trainer.update(**hyper)
    except (TypeError, ValueError) as e:
        assert not valid or before == 0, f"valid hyper-parameters {hyper} rejected: {e}"
        assert pending(trainer) == before
        return
    assert valid and before > 0
    assert pending(trainer) == 0 and stats.tokens == before * ROWS * SEQ


CALLS = ["step", "validate", "update", "get_gradients", "load_checkpoint", "load_missing_checkpoint",
         "save_existing_checkpoint", "import_missing_weights", "bad_seed", "bad_device"]


@fuzz(60)
@given(calls=st.lists(st.sampled_from(CALLS), max_size=12))
def test_fuzz_call_order(trainer, saved_checkpoint, calls):
    """Any order of calls: each works or raises its documented error, and the
    number of pending micro-batches follows step/update exactly."""
    EXAMPLES["Trainer call order"] += 1
    root, step_dir = saved_checkpoint
    missing = os.path.join(root, "no-such-checkpoint")
    expected_pending = pending(trainer)
    for call in calls:
        if call == "step":
            if expected_pending == ACCUM:
                with pytest.raises(ValueError, match="grad_accum"):
                    trainer.step(*GOOD)
            else:
                trainer.step(*GOOD)
                expected_pending += 1
        elif call == "validate":
            assert trainer.validate(*GOOD).tokens == ROWS * SEQ
        elif call == "update":
            if expected_pending == 0:
                with pytest.raises(ValueError, match="before any step"):
                    trainer.update(lr=1e-3)
            else:
                assert trainer.update(lr=1e-3).tokens == expected_pending * ROWS * SEQ
                expected_pending = 0
        elif call == "get_gradients":
            if expected_pending == 0:
                with pytest.raises(ValueError, match="step"):
                    trainer.get_gradients()
            else:
                assert set(trainer.get_gradients()) == set(trainer.parameter_names)
        elif call == "load_checkpoint":
            if expected_pending:
                with pytest.raises(ValueError, match="pending"):
                    trainer.load_checkpoint(step_dir)
            else:
                assert trainer.load_checkpoint(step_dir)["step"] == 1
        elif call == "load_missing_checkpoint":
            with pytest.raises(CheckpointError, match="no-such-checkpoint"):
                trainer.load_checkpoint(missing)
        elif call == "save_existing_checkpoint":
            with pytest.raises(ValueError if expected_pending else FileExistsError,
                               match="pending" if expected_pending else "already exists"):
                trainer.save_checkpoint(root, 1)
        elif call == "import_missing_weights":
            with pytest.raises(FileNotFoundError):
                trainer.import_weights(missing)
        elif call == "bad_seed":
            with pytest.raises(ValueError, match="seed"):
                trainer.init_weights(-1)
        else:
            with pytest.raises(ValueError, match="device"):
                trainer.get_allocations(1)
        assert pending(trainer) == expected_pending


@fuzz(20)
@given(calls=st.lists(st.sampled_from(["step", "validate", "update", "get_gradients", "get_weights",
                                        "init_weights", "import_weights", "save_checkpoint", "load_checkpoint",
                                        "get_allocations", "memory_summary", "close"]), min_size=1, max_size=6))
def test_fuzz_use_after_close(saved_checkpoint, exported_weights, tmp_path_factory, calls):
    """After close() every call raises RuntimeError ("closed"); close() again is a no-op."""
    EXAMPLES["Trainer after close"] += 1
    root, step_dir = saved_checkpoint
    tr = nanoq.Trainer(CONFIG, OPTIONS)
    tr.step(*GOOD)
    tr.close()
    arguments = {"step": GOOD, "validate": GOOD, "update": (1e-3,), "init_weights": (0,),
                 "import_weights": (exported_weights,),
                 "save_checkpoint": (str(tmp_path_factory.mktemp("closed")), 2),
                 "load_checkpoint": (step_dir,), "get_allocations": (0,)}
    for call in calls:
        if call == "close":
            tr.close()
            continue
        with pytest.raises(RuntimeError, match="closed"):
            getattr(tr, call)(*arguments.get(call, ()))


# --------------------------------------------------------------------------
# Token files (.bin)
# --------------------------------------------------------------------------

MAGIC = b"BIN.TOK\n"


def decode_token_file(data):
    """(tokens, mask or None) by the format's rules, or None when the file is invalid."""
    if len(data) < 1024 or data[:8] != MAGIC:
        return None
    version, per_token, count, vocab, has_mask = struct.unpack_from("<5i", data, 8)
    if version != 2 or per_token != 4 or count < 0 or vocab <= 0 or has_mask not in (0, 1):
        return None
    if len(data) != 1024 + 4 * count + has_mask * ((count + 7) // 8):
        return None
    tokens = np.frombuffer(data, "<i4", count, 1024)
    # Ids at or past the header's vocab are valid in the file (llm.q writes an added EOS
    # as the header's vocab); they are checked against the model's vocab when it is known.
    if (tokens < 0).any():
        return None
    if not has_mask:
        return tokens, None
    bits = np.frombuffer(data, np.uint8, offset=1024 + 4 * count)
    return tokens, np.unpackbits(bits, count=count, bitorder="little").astype(bool)


@st.composite
def token_file_bytes(draw):
    magic = draw(st.one_of(st.just(MAGIC), st.binary(min_size=8, max_size=8)))
    version = draw(st.one_of(st.just(2), int32s))
    per_token = draw(st.one_of(st.just(4), int32s))
    count = draw(st.one_of(st.integers(0, 40), st.sampled_from([INT32_MAX, INT32_MAX - 7, 2**30, -1, INT32_MIN]),
                           int32s))
    vocab = draw(st.one_of(st.integers(1, 50), st.sampled_from([0, -1, INT32_MAX, INT32_MIN]), int32s))
    has_mask = draw(st.one_of(st.sampled_from([0, 1]), int32s))
    rest = draw(st.one_of(st.just(bytes(996)), st.binary(min_size=996, max_size=996)))
    data = magic + struct.pack("<5i", version, per_token, count, vocab, has_mask) + rest
    if 0 <= count <= 40 and draw(st.booleans()):
        high = max(min(vocab, 2**20), 1) - 1
        tokens = draw(st.lists(st.one_of(st.integers(0, high), st.sampled_from([vocab, -1, INT32_MAX, INT32_MIN])),
                               min_size=count, max_size=count))
        data += struct.pack(f"<{count}i", *tokens)
        if has_mask == 1:
            data += draw(st.binary(min_size=(count + 7) // 8, max_size=(count + 7) // 8))
        data += draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=9)))
    else:
        data += draw(st.binary(max_size=200))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return data if cut is None else data[:cut]


def check_token_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
    expected = decode_token_file(data)
    outcome, peak = peak_allocation(lambda: TokenFile(path))
    assert peak < 1 << 20, f"opening a {len(data)}-byte token file allocated {peak} bytes"
    if isinstance(outcome, Exception):
        assert isinstance(outcome, ValueError), f"{type(outcome).__name__}: {outcome}"
        assert expected is None, f"a valid token file was rejected: {outcome}"
        assert path in str(outcome)
        return
    assert expected is not None, "an invalid token file was accepted"
    tokens, mask = expected
    assert np.array_equal(outcome.tokens, tokens)
    assert (outcome.mask is None) if mask is None else np.array_equal(outcome.mask, mask)
    # Against a model of the header's vocab: refused exactly when an id is past it.
    vocab = struct.unpack_from("<i", data, 20)[0]
    if (tokens >= vocab).any():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            outcome.check_vocab(vocab)
    else:
        outcome.check_vocab(vocab)


@fuzz(250)
@given(data=token_file_bytes())
def test_fuzz_token_file_headers_and_bodies(tmp_path_factory, data):
    """Random headers (counts up to 2**31 - 1, negative ones, bad magic,
    version, width, vocab, mask flag) and bodies: TokenFile reads exactly the
    valid files, raises ValueError naming the file for the rest, and never
    allocates more than 1 MiB."""
    EXAMPLES["TokenFile"] += 1
    check_token_file(str(tmp_path_factory.getbasetemp() / "fuzz.bin"), data)


@fuzz(150)
@given(tokens=st.lists(st.integers(0, 99), max_size=40), with_mask=st.booleans(),
       flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 1200)), extra=st.binary(max_size=8), data=st.data())
def test_fuzz_token_file_mutations(tmp_path_factory, tokens, with_mask, flips, cut, extra, data):
    """Byte flips, truncations and appended bytes of a valid token file."""
    EXAMPLES["TokenFile mutations"] += 1
    path = str(tmp_path_factory.getbasetemp() / "mutated.bin")
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens))), bool)
    write_tokens(path, np.array(tokens, np.int64), 100, mask if with_mask else None)
    content = bytearray(open(path, "rb").read())
    for position, value in flips:
        content[position % len(content)] = value
    content = bytes(content[:cut] if cut is not None else content) + extra
    check_token_file(path, content)


# --------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2"}


def safetensors_bytes(header, body, header_len=None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + body


@st.composite
def valid_safetensors(draw):
    """(file bytes, {name: float32 array}) with tensors packed in a random order."""
    names = draw(st.lists(st.text(min_size=1, max_size=8).filter(lambda n: n != "__metadata__"),
                          max_size=4, unique=True))
    header, expected, body = {}, {}, b""
    for name in draw(st.permutations(names)):
        dtype = draw(st.sampled_from(sorted(ST_DTYPES)))
        shape = draw(npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        raw = draw(npst.arrays(np.dtype(ST_DTYPES[dtype]), shape))
        value = np.asarray((raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(body), len(body) + raw.nbytes]}
        expected[name] = value
        body += raw.tobytes()
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    return safetensors_bytes(header, body), expected


def assert_regions_tile_the_buffer(data):
    """The data_offsets of an accepted file cover its data buffer exactly once."""
    (header_len,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + header_len])
    regions = sorted(tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__")
    position = 0
    for begin, end in regions:
        assert begin == position, f"data regions overlap or leave a hole: {regions}"
        position = end
    assert position == len(data) - 8 - header_len, f"data regions do not reach the end of the buffer: {regions}"


def read_all_safetensors(path, data):
    with open(path, "wb") as f:
        f.write(data)
    outcome, peak = peak_allocation(lambda: dict(read_safetensors(path)))
    assert peak < (1 << 20) + 8 * len(data), f"reading a {len(data)}-byte safetensors file allocated {peak} bytes"
    if isinstance(outcome, Exception):
        assert isinstance(outcome, ValueError), f"{type(outcome).__name__}: {outcome}"
        assert path in str(outcome)
    else:
        assert_regions_tile_the_buffer(data)
    return outcome


@fuzz(60)
@given(file=valid_safetensors())
def test_fuzz_safetensors_valid_files_round_trip(tmp_path_factory, file):
    EXAMPLES["read_safetensors valid"] += 1
    data, expected = file
    tensors = read_all_safetensors(str(tmp_path_factory.getbasetemp() / "valid.safetensors"), data)
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32 and np.array_equal(tensors[name], value, equal_nan=True)


dims = st.one_of(st.integers(0, 6), st.sampled_from([-1, 2**31, 2**32, 2**62 + 1, 2**63, 2**64, 2**70]),
                 st.booleans(), st.floats(0, 4), st.text(max_size=2))
offsets = st.one_of(st.integers(0, 80), st.sampled_from([-1, -8, 2**63, 2**64, 10**30]), st.floats(0, 80),
                    st.none(), st.booleans())
tensor_entries = st.one_of(
    st.fixed_dictionaries({"dtype": st.sampled_from(sorted(ST_DTYPES) + ["I32", "U8", "f32", "BOOL", ""]),
                           "shape": st.lists(dims, max_size=3),
                           "data_offsets": st.lists(offsets, min_size=2, max_size=2)}),
    st.fixed_dictionaries({}, optional={"dtype": json_values, "shape": json_values, "data_offsets": json_values}),
    json_values)


@fuzz(250)
@given(header=st.one_of(st.dictionaries(st.text(max_size=6), tensor_entries, max_size=4), json_values,
                        st.binary(max_size=40), st.sampled_from([b"[" * 50000, b'{"a": ' + b"[" * 50000])),
       header_len=st.one_of(st.none(), st.none(), st.integers(0, 200), st.sampled_from([2**63, 2**64 - 1, 10**8])),
       body=st.binary(max_size=80))
def test_fuzz_safetensors_random_headers(tmp_path_factory, header, header_len, body):
    """Random header lengths (past the file, huge), JSON (wrong types, missing
    keys, unknown dtypes, negative/overlapping/outside offsets, dims whose
    product overflows int64, deep nesting): ValueError naming the file."""
    EXAMPLES["read_safetensors random"] += 1
    read_all_safetensors(str(tmp_path_factory.getbasetemp() / "random.safetensors"),
                         safetensors_bytes(header, body, header_len))


@fuzz(150)
@given(file=valid_safetensors(), flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)),
                                                min_size=1, max_size=3),
       cut=st.one_of(st.none(), st.integers(0, 400)))
def test_fuzz_safetensors_mutations(tmp_path_factory, file, flips, cut):
    EXAMPLES["read_safetensors mutations"] += 1
    data = bytearray(file[0])
    for position, value in flips:
        data[position % len(data)] = value
    read_all_safetensors(str(tmp_path_factory.getbasetemp() / "mutated.safetensors"),
                         bytes(data[:cut] if cut is not None else data))


def test_safetensors_overlapping_and_leftover_regions_are_rejected(tmp_path):
    """Two tensors on the same bytes, a hole between tensors, or bytes past
    the last tensor: the spec forbids all three, so the reader refuses them."""
    a = np.arange(4, dtype=np.float32).tobytes()
    cases = {
        "overlap": ({"a": [0, 16], "b": [8, 24]}, a + a[:8]),
        "same bytes": ({"a": [0, 16], "b": [0, 16]}, a),
        "hole": ({"a": [0, 16], "b": [20, 36]}, a + bytes(4) + a),
        "leftover": ({"a": [0, 16]}, a + bytes(4)),
    }
    for case, (regions, body) in cases.items():
        header = {name: {"dtype": "F32", "shape": [4], "data_offsets": r} for name, r in regions.items()}
        path = tmp_path / f"{case.replace(' ', '-')}.safetensors"
        path.write_bytes(safetensors_bytes(header, body))
        with pytest.raises(ValueError, match="overlap|hole|past|cover"):
            list(read_safetensors(path))


# --------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------

HF_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128,
                 hidden_act="silu")
HF_KEYS = sorted(HF_CONFIG) + ["head_dim", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
                               "use_sliding_window", "torch_dtype"]
rope_scalings = st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["llama3", "default", "linear", "dynamic"])},
    optional={k: st.one_of(st.floats(), st.integers(-2, 10**6), json_values)
              for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                        "rope_theta")})
architectures = st.one_of(st.lists(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                                    "MistralForCausalLM", "GPT2LMHeadModel"]), max_size=2),
                          json_values)


@st.composite
def hf_config_dicts(draw):
    config = dict(HF_CONFIG)
    for key in draw(st.lists(st.sampled_from(HF_KEYS), max_size=4, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            config.pop(key, None)
        elif key in ("rope_scaling", "rope_parameters"):
            config[key] = draw(st.one_of(rope_scalings, json_values))
        elif key == "architectures":
            config[key] = draw(architectures)
        else:
            config[key] = draw(json_values)
    return config


def check_model_config(config):
    """Invariants of an accepted ModelConfig: the core can take every field."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"):
        value = getattr(config, name)
        assert type(value) is int and 0 < value <= INT32_MAX, f"{name} = {value!r}"
    assert config.head_dim % 2 == 0 and config.num_attention_heads % config.num_key_value_heads == 0
    assert math.isfinite(config.rope_theta) and config.rope_theta > 0
    assert math.isfinite(config.rms_norm_eps) and config.rms_norm_eps > 0
    if config.rope_scaling is not None:
        assert 0 < config.rope_scaling["original_max_position_embeddings"] <= INT32_MAX
    config.to_core()


@fuzz(300)
@given(raw=st.one_of(hf_config_dicts(), hf_config_dicts(), st.dictionaries(st.text(max_size=8), json_values)))
def test_fuzz_model_config_from_hf_dict(raw):
    """ModelConfig.from_hf_dict: a config the core can take, or ValueError naming the source."""
    EXAMPLES["ModelConfig.from_hf_dict"] += 1
    try:
        config = nanoq.ModelConfig.from_hf_dict(raw, source="fuzz/config.json")
    except ValueError as e:
        assert "fuzz/config.json" in str(e)
        return
    check_model_config(config)


@fuzz(120)
@given(content=st.one_of(hf_config_dicts().map(lambda d: json.dumps(d).encode()),
                         json_values.map(lambda v: json.dumps(v).encode()),
                         st.binary(max_size=40), st.just(b"[" * 100000), st.just(b'{"vocab_size": \xff}')))
def test_fuzz_model_config_from_pretrained(tmp_path_factory, content):
    """ModelConfig.from_pretrained on any config.json: ValueError naming the file."""
    EXAMPLES["ModelConfig.from_pretrained"] += 1
    directory = tmp_path_factory.getbasetemp() / "fuzz-model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_bytes(content)
    try:
        config = nanoq.ModelConfig.from_pretrained(directory)
    except ValueError as e:
        assert str(directory / "config.json") in str(e)
        return
    check_model_config(config)


# --------------------------------------------------------------------------
# trainer_state.json of a checkpoint
# --------------------------------------------------------------------------

STATE_FIELDS = ["format_version", "nanoq_version", "step", "optimizer_steps", "model_config", "options",
                "extra_state", "files", "parts"]


@st.composite
def state_documents(draw, original):
    kind = draw(st.sampled_from(["fields", "fields", "bytes", "json"]))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        content = bytearray(json.dumps(original, indent=2).encode())
        for position, value in draw(st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)),
                                             min_size=1, max_size=3)):
            content[position % len(content)] = value
        return bytes(content)
    state = json.loads(json.dumps(original))
    part = part_file_name(0, 1)
    for field in draw(st.lists(st.sampled_from(STATE_FIELDS + [f"files.{part}", "parts.processes"]), min_size=1,
                               max_size=3, unique=True)):
        value = draw(st.one_of(json_values, st.integers(-3, 3)))
        if field.startswith("files."):
            if isinstance(state.get("files"), dict):
                state["files"][part] = value
        elif field == "parts.processes":
            if isinstance(state.get("parts"), dict):
                state["parts"]["processes"] = value
        elif draw(st.integers(0, 3)) == 0:
            del state[field]
        else:
            state[field] = value
    # Mostly resealed, so that the field checks behind the state's own checksum are reached.
    state.pop("state_checksum", None)
    if draw(st.integers(0, 3)):
        state["state_checksum"] = state_checksum(state)
    return json.dumps(state).encode()


@fuzz(200)
@given(data=st.data())
def test_fuzz_checkpoint_state(saved_checkpoint, data):
    """read_state on a mutated trainer_state.json: the checked state or a
    CheckpointError naming the checkpoint."""
    EXAMPLES["read_state"] += 1
    step_dir = saved_checkpoint[1]
    file = os.path.join(step_dir, "trainer_state.json")
    with open(file, "rb") as f:
        original = f.read()
    try:
        with open(file, "wb") as f:
            f.write(data.draw(state_documents(json.loads(original))))
        try:
            state = read_state(step_dir)
        except CheckpointError as e:
            assert step_dir in str(e)
            return
        for field in ("step", "optimizer_steps"):
            assert type(state[field]) is int and state[field] >= 0
        assert isinstance(state["model_config"], dict) and state["path"] == step_dir
    finally:
        with open(file, "wb") as f:
            f.write(original)


# --------------------------------------------------------------------------
# TOML training config
# --------------------------------------------------------------------------

SCHEMA = {item.name: item for item in config_settings()}
toml_scalars = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, 300), st.floats(), st.booleans(),
                         st.text(max_size=10), st.sampled_from(["cosine", "cpu", "fp32", "auto", "ffn,qkv"]))
toml_values = st.one_of(toml_scalars, st.lists(toml_scalars, max_size=3),
                        st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), toml_scalars, max_size=2))


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


@st.composite
def toml_documents(draw):
    """(text, {section: {key: value}}) of a random config file."""
    tables = draw(st.dictionaries(
        st.one_of(st.sampled_from(SECTIONS), st.sampled_from(["models", "extra"])),
        st.dictionaries(st.one_of(st.sampled_from(sorted(SCHEMA)), st.from_regex(r"[a-z_]{1,8}", fullmatch=True)),
                        st.one_of(toml_scalars, toml_values), max_size=4),
        max_size=3))
    text = "\n".join(f"[{section}]\n" + "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in table.items())
                     for section, table in tables.items())
    return text, tables


toml_noise = st.text(alphabet="[]={}\"'.,#\n abcdefghilmnoprstuvwxyz_0123456789-+", max_size=120)


@fuzz(250)
@given(document=st.one_of(toml_documents(), toml_documents(), toml_noise.map(lambda t: (t, None)),
                          st.sampled_from([("x = " + "[" * 50000, None), ("[train]\nlr = \xff", None)])),
       invalid_utf8=st.booleans())
def test_fuzz_toml_config(tmp_path_factory, document, invalid_utf8):
    """load_config on any file: a TrainConfig holding the file's values, or
    ValueError naming the file."""
    EXAMPLES["load_config"] += 1
    text, tables = document
    path = tmp_path_factory.getbasetemp() / "fuzz.toml"
    path.write_bytes(text.encode() + (b"\n# \xff\xfe" if invalid_utf8 else b""))
    try:
        config = load_config(path)
    except ValueError as e:
        assert str(path) in str(e)
        return
    for table in (tables or {}).values():
        for name, value in table.items():
            assert getattr(config, name) == value


@fuzz(250)
@given(values=st.dictionaries(st.one_of(st.sampled_from(sorted(SCHEMA)), st.text(max_size=6)),
                              st.one_of(toml_scalars, json_values, st.sampled_from([10**400, -(10**400)])),
                              max_size=4))
def test_fuzz_train_config_from_dict(values):
    """TrainConfig.from_dict (the flags' path): a TrainConfig, or ValueError naming the key."""
    EXAMPLES["TrainConfig.from_dict"] += 1
    try:
        config = TrainConfig.from_dict(values)
    except ValueError as e:
        assert any(name in str(e) or repr(name) in str(e) for name in values), f"the error names no key: {e}"
        return
    for name, value in values.items():
        assert getattr(config, name) == value


# --------------------------------------------------------------------------
# Tokenizer inputs: JSONL, SFT and Nano lines
# --------------------------------------------------------------------------

line_text = st.text(max_size=30).filter(lambda t: "\n" not in t and "\r" not in t)
json_lines = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=30)),
    st.builds(lambda p, r: json.dumps({"prompt": p, "response": r}), st.text(max_size=10), st.text(max_size=10)),
    st.builds(lambda m: json.dumps({"messages": m}),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "bot"]),
                                              "content": st.one_of(st.text(max_size=10), json_values)}),
                       max_size=3)),
    json_values.map(json.dumps), json_values.map(lambda v: json.dumps({"text": v})),
    line_text, st.just(""), st.just("   "),
    st.sampled_from(["[" * 50000, json.dumps({"text": "x" * 200_000}), '{"text": "a"', "{'text': 1}"]))


def first_bad_jsonl_line(lines, check):
    """Line number (from 1) of the first line ``check`` rejects, or None."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return number
        if not isinstance(record, dict) or not check(record):
            return number
    return None


def valid_sft(record):
    if "messages" in record:
        messages = record["messages"]
        return isinstance(messages, list) and bool(messages) and all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in messages)
    return isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str)


@fuzz(150)
@given(lines=st.lists(json_lines, max_size=6), fmt=st.sampled_from(["jsonl", "sft"]))
def test_fuzz_jsonl_and_sft_readers(tmp_path_factory, lines, fmt):
    """read_documents: a document per good line, or InputError naming the
    file and the number of the first bad line."""
    EXAMPLES[f"read_documents {fmt}"] += 1
    path = str(tmp_path_factory.getbasetemp() / "fuzz.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    check = valid_sft if fmt == "sft" else (lambda record: isinstance(record.get("text"), str))
    bad = first_bad_jsonl_line(lines, check)
    try:
        documents = read_documents(path, fmt)
    except InputError as e:
        assert bad is not None, f"a valid file was rejected: {e}"
        assert f"{path}:{bad}:" in str(e)
        return
    assert bad is None, f"line {bad} was accepted: {lines[bad - 1][:80]!r}"
    if fmt == "sft":
        assert len(documents) == sum(1 for line in lines if line.strip())


@fuzz(60)
@given(content=st.binary(max_size=60), split=st.sampled_from(["file", "paragraph", "line"]))
def test_fuzz_text_reader(tmp_path_factory, content, split):
    EXAMPLES["read_documents text"] += 1
    path = str(tmp_path_factory.getbasetemp() / "fuzz.txt")
    with open(path, "wb") as f:
        f.write(content)
    try:
        documents = read_documents(path, "text", split=split)
    except InputError as e:
        assert path in str(e)
        with pytest.raises(UnicodeDecodeError):
            content.decode("utf-8")
        return
    assert all(text.strip() for d in documents for text, _ in d.segments)


class Forbidden:
    """Pickles to a call of ``function(*arguments)``; unpickling it must never run that call."""

    def __init__(self, function, arguments):
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


def nano_line(value, protocol):
    return base64.b64encode(pickle.dumps(value, protocol=protocol)).decode()


token_ids = st.lists(st.one_of(st.integers(0, 49), st.sampled_from([50, -1, 2**31, 2**70, -(2**70)])), max_size=6)


@st.composite
def nano_lines(draw, marker):
    """(line, expectation): the decoded (ids, mask) it must give, "error", or None when unknown."""
    protocol = draw(st.integers(0, pickle.HIGHEST_PROTOCOL))
    kind = draw(st.sampled_from(["ids", "mask", "labels", "dict", "data", "forbidden", "bytes", "text"]))
    if kind == "ids":
        ids = draw(token_ids)
        return nano_line(draw(st.sampled_from([list, tuple]))(ids), protocol), (ids, None)
    if kind in ("mask", "labels", "dict"):
        ids = draw(token_ids)
        mask = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
        if kind == "mask":
            return nano_line((ids, [int(m) for m in mask]), protocol), (ids, mask)
        labels = [i if m else -100 for i, m in zip(ids, mask)]
        if kind == "dict":
            return nano_line({"input_ids": ids, "labels": labels}, protocol), (ids, mask)
        # The documented rule: a second list holding -100 or a value above 1 is labels, else a mask.
        if any(v == -100 or v > 1 for v in labels):
            expected = (ids, mask)
        elif all(v in (0, 1) for v in labels):
            expected = (ids, [bool(v) for v in labels])
        else:
            expected = "error"
        return nano_line((ids, labels), protocol), expected
    if kind == "data":
        return nano_line(draw(json_values), protocol), None
    if kind == "forbidden":
        call = draw(st.sampled_from([
            (os.system, (f"touch {marker}",)), (open, (marker, "w")), (exec, (f"open({marker!r}, 'w')",)),
            (eval, (f"open({marker!r}, 'w')",)), (str, ([[[]]],)), (list, ((1, 2),))]))
        value = Forbidden(*call)
        return nano_line(draw(st.sampled_from([value, [value], {"input_ids": value}])), protocol), "error"
    if kind == "bytes":
        return base64.b64encode(draw(st.binary(max_size=30))).decode(), None
    return draw(line_text.filter(lambda t: t.strip())), None


@fuzz(150)
@given(data=st.data())
def test_fuzz_nano_importer(tmp_path_factory, data):
    """import_nano: the decoded lines, or InputError naming file:line; a
    pickle naming a function (os.system, open, exec, even builtins.str) is
    refused and never run."""
    EXAMPLES["import_nano"] += 1
    base = tmp_path_factory.getbasetemp()
    marker = str(base / "pickle-ran")
    lines = data.draw(st.lists(st.one_of(nano_lines(marker), st.just(("", "blank"))), min_size=1, max_size=5))
    path = str(base / "fuzz.nano")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(line for line, _ in lines))
    output = base / f"nano-out-{EXAMPLES['import_nano']}"
    try:
        result = import_nano([path], output, vocab_size=50)
    except InputError as e:
        if not any(line.strip() for line, _ in lines):
            assert "the corpus is empty" in str(e)
            return
        match = re.search(re.escape(path) + r":(\d+):", str(e))
        assert match, f"the error does not name the line: {e}"
        number = int(match.group(1))
        expectation = lines[number - 1][1]
        assert lines[number - 1][0].strip()
        if isinstance(expectation, tuple):  # a well-formed line fails only for its token ids
            assert any(not 0 <= i < 50 for i in expectation[0]), str(e)
        assert not output.exists()
    else:
        assert not any(expectation == "error" for _, expectation in lines)
        assert result.documents == sum(1 for line, _ in lines if line.strip())
        decoded = [(ids, mask) for _, ids, mask in read_nano_lines(path)]
        expected = [e for _, e in lines if isinstance(e, tuple)]
        if len(expected) == len(decoded):
            assert decoded == [(ids, mask) for ids, mask in expected]
    assert not os.path.exists(marker), "a pickle in the input was executed"


# --------------------------------------------------------------------------
# Item 5: nothing is unpickled or evaluated outside the restricted importer
# --------------------------------------------------------------------------

SOURCE_ROOTS = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                for d in ("pylib", "cli")]
RESTRICTED_UNPICKLER = os.path.join("tokenization", "nano.py")
UNSAFE_LOADERS = re.compile(r"\bimport\s+(pickle|cPickle|_pickle|dill|cloudpickle|marshal|shelve|joblib)\b"
                            r"|\bfrom\s+(pickle|_pickle|marshal|shelve|dill|cloudpickle|joblib)\s+import\b"
                            r"|\btorch\.load\(|\byaml\.(unsafe_)?load\(|(?<![.\w])(eval|exec)\(|__import__\("
                            r"|allow_pickle\s*=\s*True")


def test_nothing_unpickles_or_evaluates_outside_the_nano_importer():
    """A source scan: no module under pylib/ or cli/ imports pickle (or
    marshal, shelve, ...), calls torch.load, yaml.load, eval or exec, or loads
    numpy files with allow_pickle=True; the one exception is the restricted
    unpickler of the Nano importer, which imports pickle and nothing else."""
    offenders, scanned = [], 0
    for root in SOURCE_ROOTS:
        for directory, _, files in os.walk(root):
            for name in files:
                if not name.endswith((".py", ".pyx")):
                    continue
                path = os.path.join(directory, name)
                scanned += 1
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        code = line.split("#", 1)[0]
                        for match in UNSAFE_LOADERS.finditer(code):
                            if path.endswith(RESTRICTED_UNPICKLER) and match.group(0) == "import pickle":
                                continue
                            offenders.append(f"{path}:{number}: {line.strip()}")
    assert scanned > 20, "the scan found no sources"
    assert not offenders, "unsafe deserialisation outside the restricted Nano unpickler:\n" + "\n".join(offenders)
