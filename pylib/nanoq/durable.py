"""Files nanoq relies on: durable writes (fsync of files and folders, JSON
written to disk) and checked reads of JSON objects.

Everything nanoq writes that must survive a crash (token files, checkpoints,
exported models) is built under a temporary name, fsynced with these, and
renamed into place; the folder holding it is fsynced after the rename.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
from typing import Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a folder (which makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike, exist_ok: bool = False) -> None:
    """os.makedirs, and each folder it creates is made durable in its
    parent (fsync of the parent), so that what is later saved inside it
    cannot vanish with it in a power loss."""
    path = os.path.abspath(os.fspath(path))
    missing = []
    at = path
    while not os.path.isdir(at) and os.path.dirname(at) != at:
        missing.append(at)
        at = os.path.dirname(at)
    os.makedirs(path, exist_ok=exist_ok)
    for folder in reversed(missing):
        fsync_path(os.path.dirname(folder))


def _umask() -> int:
    """This process's umask, read without changing it where the system
    allows (os.umask can only be read by setting it, which races with
    other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_created_mode(path: str | os.PathLike) -> None:
    """Gives the file ``path`` the mode a plain ``open(path, "w")`` would:
    0666 less the umask. Writers that go through a private temporary file
    (safetensors' save_file makes its files 0600) would otherwise leave
    files others cannot read beside JSON files they can."""
    os.chmod(path, 0o666 & ~_umask())


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """safetensors' save_file, with its failures to write (a full disk: its
    own SafetensorError, "os error 28") raised as the OSError every other
    write of nanoq raises, errno included."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, os.fspath(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), f"{os.strerror(int(code[1]))} (safetensors: {e})", os.fspath(path)) from None


def write_json(path: str | os.PathLike, value, **dump_options) -> None:
    """Writes ``value`` as indented JSON (no NaN/inf) and fsyncs the file."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, allow_nan=False, **dump_options)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all: into
    ``.<name>.partial-<pid>`` beside it, fsynced, renamed over ``path``
    (an old file stays until then: a full disk or a kill mid-write leaves
    it as it was), and the folder fsynced."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.partial-{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    fsync_path(folder)


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


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False


def _remove_abandoned(directory: str) -> None:
    """Removes ``<directory>.partial-<pid>`` and ``.replaced-<pid>`` folders
    that a killed ``new_directory`` left (its process is gone): a copy of
    a whole model otherwise stays on disk for good."""
    parent, name = os.path.split(directory)
    try:
        siblings = os.listdir(parent)
    except OSError:
        return
    # A replaced folder is the only copy when the kill came between the two
    # renames of a replacement: it stays unless the folder is there again.
    kinds = (".partial-", ".replaced-") if os.path.isdir(directory) else (".partial-",)
    for sibling in siblings:
        for kind in kinds:
            pid = sibling[len(name) + len(kind):] if sibling.startswith(name + kind) else ""
            if pid.isdigit() and int(pid) != os.getpid() and _process_gone(int(pid)):
                shutil.rmtree(os.path.join(parent, sibling), ignore_errors=True)


# renameat2's flag and "relative to the working directory" (Linux, <linux/fs.h>, <fcntl.h>).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swaps the paths ``a`` and ``b`` in one step (Linux's renameat2 with
    RENAME_EXCHANGE): True when done, False where the C library or the
    filesystem cannot (then nothing moved); OSError for any other failure."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc 2.28+ / not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _replace_directory(new: str, target: str) -> None:
    """Puts the folder ``new`` in place of the existing folder ``target``
    and deletes the old one. Where the filesystem swaps two paths in one
    step, ``target`` names the old or the new folder at every moment, and
    the old one, swapped to ``new``'s name (``.partial-<pid>``), goes as an
    abandoned partial folder would if the process dies deleting it.
    Elsewhere the old folder is renamed to ``<target>.replaced-<pid>`` and
    the new one renamed in: a kill between the two renames leaves the old
    one there (kept by _remove_abandoned while ``target`` is missing), and
    a failed second rename puts it back. A failure to delete the old folder
    once the new one is in place is not an error."""
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)
        return
    replaced = f"{target}.replaced-{os.getpid()}"
    shutil.rmtree(replaced, ignore_errors=True)
    os.rename(target, replaced)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(replaced, target)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


@contextlib.contextmanager
def new_directory(directory: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Builds ``directory`` so that it appears complete or not at all.

    Yields the absolute path of ``<directory>.partial-<pid>`` to fill; when
    the block ends, every file in it and the folder itself are fsynced and it
    is renamed to ``directory``, and the parent folder is fsynced. Every
    file in it gets the mode of a file the user creates (0666 less the
    umask; see give_created_mode), whoever wrote it. If the
    block raises, the partial folder is removed; those of killed earlier
    calls (their process gone) are removed first. An existing ``directory``
    raises FileExistsError first unless ``overwrite`` (then it is replaced,
    see _replace_directory).
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.lexists(directory):
        if not overwrite:
            raise FileExistsError(f"{directory} already exists; not overwriting it (choose a new directory)")
        if not os.path.isdir(directory) or os.path.islink(directory):
            raise FileExistsError(f"{directory} exists and is not a directory; not overwriting it")
    _remove_abandoned(directory)
    partial = f"{directory}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash of a process with our pid
    os.makedirs(partial)
    try:
        yield partial
        for name in os.listdir(partial):
            path = os.path.join(partial, name)
            if os.path.isfile(path) and not os.path.islink(path):
                give_created_mode(path)
            fsync_path(path)
        fsync_path(partial)
        if os.path.lexists(directory):
            _replace_directory(partial, directory)
        else:
            os.rename(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync_path(os.path.dirname(directory))
