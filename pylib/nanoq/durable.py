"""Files nanoq relies on: durable writes (fsync of files and folders, JSON
written to disk) and checked reads of JSON objects.

Everything nanoq writes that must survive a crash (token files, checkpoints,
exported models) is built under a temporary name, fsynced with these, and
renamed into place; the folder holding it is fsynced after the rename.
"""
from __future__ import annotations

import json
import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a folder (which makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, value, **dump_options) -> None:
    """Writes ``value`` as indented JSON (no NaN/inf) and fsyncs the file."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, allow_nan=False, **dump_options)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_object(file: str | os.PathLike, error: type = ValueError) -> dict:
    """The JSON object in ``file``; ``error`` naming the file when it is not
    valid UTF-8 JSON (or too deeply nested) or not an object.
    FileNotFoundError passes through for the caller to word."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise error(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{file} must hold a JSON object")
    return value
