"""Reading Hugging Face weights: safetensors files and sharded index files.

The safetensors reader is our own so that bf16 tensors (which numpy lacks)
can be widened to float32 and every header field is checked against the file
before any data is touched.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Dict, Iterator, List, Tuple

import numpy as np

_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read
}


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors(path: str | os.PathLike) -> Iterator[Tuple[str, np.ndarray]]:
    """Yields (name, float32 array) for every tensor of one .safetensors file.

    Raises ValueError if the header is malformed or disagrees with the file;
    the whole header is checked before the first tensor is yielded (see
    ``safetensors_views``).
    """
    for name, dtype_name, view in safetensors_views(path):
        yield name, as_float32(view, dtype_name)


def as_float32(view: np.ndarray, dtype_name: str) -> np.ndarray:
    """A float32 copy of a view that ``safetensors_views`` gave, of the
    safetensors dtype ``dtype_name`` (bf16 widened), with the view's shape."""
    array = _bf16_to_f32(view) if dtype_name == "BF16" else view
    # reshape: ascontiguousarray makes 0-d (scalar) tensors 1-d
    return np.ascontiguousarray(array, dtype=np.float32).reshape(view.shape)


def safetensors_views(path: str | os.PathLike) -> List[Tuple[str, str, np.ndarray]]:
    """(name, safetensors dtype, memory-mapped view) of every tensor of a
    file, after checking the whole header against the file; no data is read.
    As the safetensors format requires, the tensors' data_offsets must tile
    the data buffer exactly: no overlaps, no holes, no bytes after the last.
    """
    return safetensors_file(path)[1]


def safetensors_file(path: str | os.PathLike) -> Tuple[object, List[Tuple[str, str, np.ndarray]]]:
    """The header's ``__metadata__`` as the file has it (None when absent;
    unchecked: its meaning is the writer's) and the views of
    ``safetensors_views``, checked as it says."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path}: header length {header_len} exceeds the file")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = header.get("__metadata__")
    data_start = 8 + header_len
    data_bytes = size - data_start
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_bytes,)) \
        if data_bytes else np.zeros(0, np.uint8)
    tensors = []  # (begin, end, name, dtype name, view of the data)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {name!r} is not an object")
        dtype_name = entry.get("dtype")
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(_is_index(d) for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_index(o) for o in offsets)):
            raise ValueError(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        if not begin <= end <= data_bytes or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} data_offsets {offsets} do not fit its shape {shape} "
                             f"or the file")
        try:
            view = data[begin:end].view(dtype).reshape(shape)
        except ValueError as e:  # a zero-size shape with dimensions numpy cannot represent
            raise ValueError(f"{path}: tensor {name!r} has an unusable shape {shape}: {e}") from None
        tensors.append((begin, end, name, dtype_name, view))
    position = 0
    for begin, end, name, _, _ in sorted(tensors):
        if begin != position:
            raise ValueError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] "
                             f"{'overlap another tensor' if begin < position else 'leave a hole before it'}; "
                             f"tensors must tile the data buffer")
        position = end
    if position != data_bytes:
        raise ValueError(f"{path}: {data_bytes - position} bytes past the last tensor's data; "
                         f"tensors must cover the data buffer exactly")
    return metadata, [(name, dtype_name, view) for _, _, name, dtype_name, view in tensors]


# Tensors some Hugging Face checkpoints carry that are not parameters.
_NOT_PARAMETERS = (".rotary_emb.inv_freq",)


def is_parameter(name: str, tie_word_embeddings: bool) -> bool:
    """Whether a checkpoint tensor is a model parameter nanoq loads (not a
    buffer such as RoPE's inv_freq, nor the lm_head a tied model shares with
    its embedding)."""
    return not (name.endswith(_NOT_PARAMETERS) or (name == "lm_head.weight" and tie_word_embeddings))


def weight_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a model: a directory, a file, or an index JSON."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            path = index
        elif os.path.exists(single):
            return [single]
        else:
            pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                       if os.path.exists(os.path.join(path, name))]
            hint = f" (its {pickled[0]} is a pickle, which nanoq does not read: save the model as safetensors, " \
                   f"e.g. transformers' save_pretrained(folder, safe_serialization=True))" if pickled else ""
            raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json"
                                    f"{hint}")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}: not a safetensors index (no weight_map)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
            raise ValueError(f"{path}: weight_map must map tensor names to shard file names")
        base = os.path.dirname(path)
        files = sorted(set(weight_map.values()))
        for file in files:
            if os.path.basename(file) != file:
                raise ValueError(f"{path}: shard name {file!r} must be a plain file name")
        return [os.path.join(base, file) for file in files]
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such weights file: {path}")
    return [path]


# Bytes read from each end of each weight file for model_fingerprint.
_FINGERPRINT_BYTES = 1 << 20


def model_fingerprint(path: str | os.PathLike) -> str:
    """A fingerprint of a model's weights (a folder, file or index, as
    weight_files takes): sha256 over each weight file's name, size, and first
    and last MiB (the header and the first and last tensors' bytes). Equal
    for a moved or copied model; a fine-tune of the same architecture
    differs in those bytes. Reads at most 2 MiB per file."""
    digest = hashlib.sha256()
    for file in weight_files(path):
        size = os.path.getsize(file)
        digest.update(f"{os.path.basename(file)}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            if size > _FINGERPRINT_BYTES:
                f.seek(max(size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
                digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


def weight_shapes(path: str | os.PathLike) -> Dict[str, Tuple[int, ...]]:
    """{name: shape} of every tensor of a model (all its files' headers
    checked, no data read). Raises ValueError for a name in two shards."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    for file in weight_files(path):
        for name, _, view in safetensors_views(file):
            if name in shapes:
                raise ValueError(f"tensor {name!r} appears in more than one shard")
            shapes[name] = tuple(view.shape)
    return shapes


def read_weights_named(path: str | os.PathLike, names) -> Dict[str, np.ndarray]:
    """{name: float32 array} of the tensors of a model named in ``names``
    (those it has), reading only their data."""
    wanted, found = set(names), {}
    for file in weight_files(path):
        for name, dtype_name, view in safetensors_views(file):
            if name in wanted:
                found[name] = as_float32(view, dtype_name)
    return found


def iter_weights(path: str | os.PathLike) -> Iterator[Tuple[str, np.ndarray]]:
    """Yields (name, float32 array) for every tensor of a model, one at a time."""
    seen = set()
    for file in weight_files(path):
        for name, array in read_safetensors(file):
            if name in seen:
                raise ValueError(f"tensor {name!r} appears in more than one shard")
            seen.add(name)
            yield name, array
