"""Importing Nano's line datasets: one base64-encoded pickle per line.

Accepted line contents (after base64 and unpickling):

- pretraining: a list (or tuple) of token ids, e.g. ``[464, 3290, 318]``, or
  the pair ``[ids, None]`` that Nano's own data.py writes; all tokens are
  trained on.
- SFT, a pair ``(input_ids, second)`` (list or tuple) or a dict
  ``{"input_ids": [...], "mask": [...]}`` / ``{"input_ids": [...], "labels": [...]}``:
  ``mask`` holds one 0/1 (or bool) per token, 1 = trained on as a target;
  ``labels`` follows Hugging Face: one entry per token, -100 where it is not
  trained on. In a pair, ``second`` is read as labels if it holds -100 or a
  value above 1, else as a mask.

Sequences are concatenated as they are (Nano's lines carry their own special
tokens); ``eos_id`` appends one more token after each line.

Pickles are decoded by a restricted unpickler that resolves no global at all:
the accepted contents are built by the pickle's own opcodes, and a pickle that
names any class or function (``os.system``, ``numpy...``, even ``builtins.str``)
is refused before anything is called, so reading a file never executes code
from it. (Allowing even ``str`` would let a pickle of a few hundred bytes make
the repr of a shared-reference structure exponentially large.)
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Iterator, List, Optional, Tuple

from nanoq.tokenization.sources import InputError

class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the pickle refers to {module}.{name}; Nano lines hold only lists, tuples, "
                                     f"dicts, ints, strings and bools, which need no globals")


def safe_loads(data: bytes):
    """Unpickles ``data`` without resolving any global (class or function).
    Opcodes still build plain data (bytes, floats, None, ...), which the
    callers reject by type."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def _int_list(values, what: str, where: str) -> List[int]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) for v in values):
        raise InputError(f"{where}: {what} must be a list of integers")
    return [int(v) for v in values]


def decode_line(line: str, where: str) -> Tuple[List[int], Optional[List[bool]]]:
    """(token ids, mask or None) of one line; ``where`` names it in errors."""
    try:
        data = base64.b64decode(line.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"{where}: not base64 ({e})") from None
    try:
        value = safe_loads(data)
    except pickle.UnpicklingError as e:
        raise InputError(f"{where}: refused to unpickle: {e}") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickles raise many kinds
        raise InputError(f"{where}: not a valid pickle ({type(e).__name__}: {e})") from None

    if isinstance(value, dict):
        ids = _int_list(value.get("input_ids"), "input_ids", where)
        if "mask" in value:
            return ids, _mask(value["mask"], ids, where)
        if "labels" in value:
            return ids, _labels_to_mask(value["labels"], ids, where)
        raise InputError(f"{where}: a dict line needs input_ids and mask or labels "
                         f"(keys: {', '.join(map(str, value))})")
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple)) \
            and value[1] is None:
        return _int_list(value[0], "input ids", where), None
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (list, tuple)) for v in value):
        ids = _int_list(value[0], "input ids", where)
        second = _int_list(value[1], "mask/labels", where)
        if any(v == -100 or v > 1 for v in second):
            return ids, _labels_to_mask(second, ids, where)
        return ids, _mask(second, ids, where)
    return _int_list(value, "a pretraining line", where), None


def _mask(values, ids: List[int], where: str) -> List[bool]:
    values = _int_list(values, "mask", where)
    if len(values) != len(ids) or any(v not in (0, 1) for v in values):
        raise InputError(f"{where}: mask must hold one 0/1 per token ({len(ids)} tokens, got {len(values)} "
                         f"values)")
    return [bool(v) for v in values]


def _labels_to_mask(values, ids: List[int], where: str) -> List[bool]:
    values = _int_list(values, "labels", where)
    if len(values) != len(ids):
        raise InputError(f"{where}: labels must have one entry per token ({len(ids)} tokens, got {len(values)})")
    return [v != -100 for v in values]


def read_nano_lines(path: str) -> Iterator[Tuple[int, List[int], Optional[List[bool]]]]:
    """(line number from 1, token ids, mask or None) for every non-blank line of a Nano line file."""
    with open(path, encoding="ascii", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield (number, *decode_line(line, f"{path}:{number}"))
