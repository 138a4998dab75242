"""Reading a corpus into documents: plain text, JSONL with a text field, and SFT JSONL.

A Document is a list of segments, each ``(text, trained)``; ``text`` None
stands for the EOS token. ``trained`` is the mask bit its tokens get (1 =
trained on as a target). Pretraining documents are one trained segment; SFT
documents train only on the response. A Document stays one document in the
token files (they record where each starts), whatever EOS segments it holds:
a chat is packed whole, every turn attending to the turns before it.

SFT lines (``--format sft``) are JSON objects of one of two shapes:

- ``{"prompt": str, "response": str}``: the prompt's tokens (mask 0), then
  the response's tokens and EOS (mask 1). The prompt is used as it is, so it
  may carry any template of its own.
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``,
  rendered with this template (``<|role|>`` markers are special tokens of
  tokenizers nanoq trains; other tokenizers see them as text)::

      <|system|>\\n{content}\\n          mask 0
      <|user|>\\n{content}\\n            mask 0
      <|assistant|>\\n                   mask 0
      {content}<EOS>                     mask 1  (every assistant turn)
      <EOS>                              mask 0  (when the last turn is not the assistant's)

``chat_template(eos)`` is the same template in Jinja, for Hugging Face's
``tokenizer.apply_chat_template`` (``nanoq tokenize --format sft`` writes it
into tokenizer_config.json).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterator, List, Optional, Tuple

Segment = Tuple[Optional[str], bool]
SPLITS = ("file", "paragraph", "line")
ROLES = ("system", "user", "assistant")
# A \u escape of a UTF-16 surrogate: json.loads turns one without its pair into a
# lone surrogate, a str that is not text (it cannot be encoded, nor tokenized).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclasses.dataclass
class Document:
    """segments: [(text or None for EOS, trained)]; eos_trained: the mask bit
    of the EOS that ends the document (added unless the last segment is EOS).
    markup: (segment index, length) of each segment that starts with a
    template's own marker (the chat template's ``<|role|>``): those first
    ``length`` characters are nanoq's markup, not the data's text, and stay
    a special token where the data's spelling of one does not
    (``special_text="text"``, see nanoq.tokenization.pipeline.Encoder)."""

    segments: List[Segment]
    eos_trained: bool = True
    markup: Tuple[Tuple[int, int], ...] = ()


class InputError(ValueError):
    """Bad input data; the message names the file and line."""


def _paragraphs(lines: List[str]) -> Iterator[str]:
    """The runs of non-blank lines (a blank line: whitespace only), each
    joined by newlines."""
    run: List[str] = []
    for line in lines + [""]:
        if line.strip():
            run.append(line)
        elif run:
            yield "\n".join(run)
            run = []


def read_text(path: str, split: str = "file") -> Iterator[Document]:
    """Documents of a UTF-8 text file: the whole file, each paragraph (runs
    of lines between blank, or whitespace-only, lines) or each non-blank
    line, per ``split``. Lines end at a newline only (\\n, \\r\\n or \\r, all
    read as \\n), not at the other line boundaries of str.splitlines (form
    feed, U+2028, ...), which stay text. A UTF-8 byte order mark that starts
    the file is dropped."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    try:
        with open(path, encoding="utf-8-sig") as f:  # newline=None: \r\n and \r are read as \n
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e})") from None
    if split == "file":
        pieces = [text]
    elif split == "paragraph":
        pieces = list(_paragraphs(text.split("\n")))
    else:
        pieces = text.split("\n")
    for piece in pieces:
        if piece.strip():
            yield Document([(piece, True)])


def iter_jsonl(path: str) -> Iterator[Tuple[int, dict]]:
    """(line number from 1, object) for every non-blank line of a JSONL file
    (a UTF-8 byte order mark that starts the file is dropped). A line whose
    strings hold a lone surrogate (an unpaired \\ud800-\\udfff escape) is an
    InputError, as invalid JSON is."""
    # A .json file (one document spread over lines, or an array) is read as JSON Lines too: say so.
    lines_hint = "; a .json file is read as JSON Lines, one object per line (--format text reads it as text)" \
        if path.lower().endswith(".json") else ""
    with open(path, encoding="utf-8-sig", errors="strict") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:  # (json's message may end in "at")
                raise InputError(f"{path}:{number}: not valid JSON ({e.msg.removesuffix(' at')} at column "
                                 f"{e.colno}){lines_hint}") from None
            except RecursionError:
                raise InputError(f"{path}:{number}: JSON nested too deeply") from None
            if not isinstance(value, dict):
                raise InputError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}{lines_hint}")
            if _SURROGATE_ESCAPE.search(line):
                try:
                    json.dumps(value, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InputError(f"{path}:{number}: a string holds the lone surrogate {e.object[e.start]!r} "
                                     f"(half of a UTF-16 pair, escaped without its other half), which is not "
                                     f"text; fix or drop the line") from None
            yield number, value


def read_jsonl(path: str, text_field: str = "text") -> Iterator[Document]:
    """One pretraining document per line: the string ``line[text_field]``."""
    for number, record in iter_jsonl(path):
        text = record.get(text_field)
        if not isinstance(text, str):
            if text_field in record:  # (the field is there: --text-field is not what is wrong)
                raise InputError(f"{path}:{number}: field {text_field!r} holds {type(text).__name__} "
                                 f"{json.dumps(text)[:40]}, not a string of text")
            keys = ", ".join(sorted(record)) or "none"
            hint = " (prompt/response or messages data needs --format sft)" \
                if {"prompt", "messages"} & set(record) else ""
            raise InputError(f"{path}:{number}: has no field {text_field!r} (keys: {keys}); "
                             f"set --text-field{hint}")
        if text:
            yield Document([(text, True)])


def sft_document(record: dict, where: str) -> Document:
    """The Document of one SFT record (see the module docstring)."""
    if "messages" in record and ("prompt" in record or "response" in record):
        raise InputError(f"{where}: an SFT line has 'messages' and 'prompt'/'response': give one of the two forms")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: 'messages' must be a non-empty list")
        segments: List[Segment] = []
        markup: List[Tuple[int, int]] = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES \
                    or not isinstance(message.get("content"), str):
                raise InputError(f"{where}: messages[{index}] must be an object with role "
                                 f"({'/'.join(ROLES)}) and string content, got {message!r:.80}")
            role, content = message["role"], message["content"]
            marker = f"<|{role}|>"
            markup.append((len(segments), len(marker)))
            if role == "assistant":
                segments += [(f"{marker}\n", False), (content, True), (None, True)]
            else:
                segments.append((f"{marker}\n{content}\n", False))
        return Document(segments, eos_trained=False, markup=tuple(markup))
    prompt, response = record.get("prompt"), record.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise InputError(f"{where}: an SFT line needs string fields 'prompt' and 'response', or "
                         f"'messages' (keys: {', '.join(sorted(record)) or 'none'})")
    return Document([(prompt, False), (response, True), (None, True)], eos_trained=False)


# Jinja for transformers' apply_chat_template, rendering as sft_document does.
# The assistant's content and its EOS (what nanoq trains on) sit in a
# {% generation %} block, so return_assistant_tokens_mask gives nanoq's mask.
_CHAT_TEMPLATE = """\
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<|assistant|>\\n' -}}
{%- generation -%}{{- message['content'] + EOS -}}{%- endgeneration -%}
{%- else -%}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\\n' -}}
{%- elif messages[-1]['role'] != 'assistant' -%}
{{- EOS -}}
{%- endif -%}"""


def chat_template(eos_token: str, bos_text: str = "") -> str:
    """The template of ``messages`` SFT lines (module docstring) as a Jinja
    chat template with ``eos_token`` (the EOS token's text) written in:
    ``apply_chat_template(messages)`` renders the text nanoq tokenizes, its
    ``{% generation %}`` blocks the trained part (the assistant's turns and
    their EOS), and ``add_generation_prompt=True`` ends with the assistant's
    marker instead of the closing EOS, to prompt a model. nanoq encodes each
    segment apart (the assistant's marker apart from its reply, as a prompt
    made with add_generation_prompt=True is encoded), transformers the whole
    text at once: the ids agree for a tokenizer whose markers are single
    tokens (as those nanoq trains), except where a reply starts with
    whitespace that the tokenizer's merges join to the marker's newline.
    bos_text: the text of the ids that start each document (the tokenizer's
    BOS, see bos_prefix), which the template writes first."""
    start = "{{- " + json.dumps(bos_text) + " -}}\n" if bos_text else ""
    return "{%- set EOS = " + json.dumps(eos_token) + " -%}\n" + start + _CHAT_TEMPLATE


def read_sft(path: str) -> Iterator[Document]:
    """One SFT document per line of a JSONL file."""
    for number, record in iter_jsonl(path):
        yield sft_document(record, f"{path}:{number}")


def detect_format(path: str) -> str:
    """``jsonl`` for .jsonl/.json files, ``text`` otherwise."""
    return "jsonl" if path.lower().endswith((".jsonl", ".json")) else "text"


def read_documents(path: str, fmt: str = "auto", text_field: str = "text", split: str = "file") -> List[Document]:
    """All documents of one input file in format ``fmt`` (auto, text, jsonl, sft)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input {path!r} does not exist or is not a file")
    fmt = detect_format(path) if fmt == "auto" else fmt
    try:
        if fmt == "text":
            return list(read_text(path, split))
        if fmt == "jsonl":
            return list(read_jsonl(path, text_field))
        if fmt == "sft":
            return list(read_sft(path))
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e})") from None
    raise ValueError(f"unknown format {fmt!r}; use auto, text, jsonl or sft (nano lines go through import_nano)")
