"""How this nanoq was installed, for hints that say how to add an extra.

nanoq installed from a package index takes ``pip install "nanoq[plot]"``;
one installed from a source folder (``pip install .``, also editable) is not
on any index under that name, so the hint names the folder it came from, as
pip's ``direct_url.json`` records it.
"""
from __future__ import annotations

import json
import importlib.metadata
from typing import Optional
from urllib.parse import unquote, urlparse


def source_folder() -> Optional[str]:
    """The local folder nanoq was installed from, or None (installed from an
    index or a wheel file, or not installed at all: running from a checkout)."""
    try:
        text = importlib.metadata.distribution("nanoq").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    url = urlparse(record.get("url", "")) if isinstance(record, dict) else None
    if url is None or url.scheme != "file" or "dir_info" not in record:
        return None
    return unquote(url.path)


def extra_install_command(extra: str) -> str:
    """The pip command that adds ``extra`` (e.g. "plot") to this install:
    ``pip install "nanoq[plot]"``, or for a source install
    ``pip install "/path/to/nanoq[plot]"``."""
    folder = source_folder()
    return f'pip install "{folder}[{extra}]"' if folder else f'pip install "nanoq[{extra}]"'
