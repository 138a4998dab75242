"""Tokenizers: a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers``
library, or a byte-level BPE trained on the corpus itself (offline).

Every tokenizer nanoq uses has an end-of-sequence token, written between
documents. Trained tokenizers reserve the ids 0..3 for the special tokens below
(the chat markers are single tokens, so the SFT template costs one token each).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Iterable, List, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS_TOKEN,) + CHAT_MARKERS
# Tried in order when neither the user nor tokenizer_config.json names the EOS token.
_KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")
MIN_TRAINED_VOCAB = 256 + len(SPECIAL_TOKENS)
_MAX_TRAINED_VOCAB = 2**24  # far beyond any released model (~256k); the trainer allocates ~70 bytes per entry


def tokenizer_file(path: str | os.PathLike) -> str:
    """The ``tokenizer.json`` at ``path`` (the file itself or a model directory)."""
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no tokenizer.json at {path!r} (give the file or a directory holding it)")
    return file


# The tokenizers of the files loaded last, by (path, size, mtime): each
# Tokenizer object that encodes keeps a few MB that the tokenizers library
# never gives back (measured with 0.23: about 6 MB per fresh tokenizer over
# the demo plays, nothing for the same one again), so a process that trains
# on the demo many times (a notebook) grew by that much per run.
_LOADED: "OrderedDict[tuple, Tokenizer]" = OrderedDict()
_LOADED_MOST = 8


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A Hugging Face fast tokenizer from a ``tokenizer.json`` file or model directory.

    Truncation and padding saved in the file (many carry a max_length for
    transformers' batches) are turned off: nanoq encodes whole documents and
    prompts, and a truncated document would silently lose its end, a padded
    one gain tokens that are not its text. The worker processes of
    ``nanoq tokenize`` get this tokenizer (``to_str()``), settings included.
    A file loaded before (unchanged: same size and modification time) gives
    the same Tokenizer object again: callers use it as it is (encode,
    decode), never change its settings.
    """
    file = tokenizer_file(path)
    stat = os.stat(file)
    key = (os.path.realpath(file), stat.st_size, stat.st_mtime_ns)
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    tokenizer = _read_tokenizer(file)
    _LOADED[key] = tokenizer
    while len(_LOADED) > _LOADED_MOST:
        _LOADED.popitem(last=False)
    return tokenizer


def _read_tokenizer(file: str) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        # Its message places a field it misses as a JSON error ("expected `,` or `}` at line 1 column 5").
        try:
            with open(file, encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, ValueError):
            fields = None
        if isinstance(fields, dict) and "model" not in fields or isinstance(fields, list):
            raise ValueError(f"{file} is JSON but not a tokenizer.json (it has no \"model\"): give the "
                             f"tokenizer.json of a Hugging Face tokenizer, or a model directory holding one") from None
        raise ValueError(f"{file} is not a tokenizer.json the tokenizers library can read: {e}") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _configured_token(file: str, key: str) -> Optional[str]:
    """The ``key`` token (eos_token, mask_token) of a tokenizer_config.json beside ``file``, if any."""
    config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as f:
            token = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _configured_eos(file: str) -> Optional[str]:
    """The ``eos_token`` of a tokenizer_config.json beside ``file``, if any."""
    return _configured_token(file, "eos_token")


_KNOWN_MASKS = ("<mask>", "[MASK]", "<|mask|>")


def find_mask_id(tokenizer_dir: Optional[str], mask_token: str = "", vocab_size: int = 0) -> int:
    """Id of the mask token a denoising model is trained and sampled with.

    mask_token: an id ("7") or a token's text; "" = the tokenizer's own: the
    ``mask_token`` of the tokenizer_config.json in ``tokenizer_dir``, else
    the first of ``<mask>``, ``[MASK]``, ``<|mask|>`` in its vocabulary.
    tokenizer_dir: the directory of the tokenizer.json (None: there is none,
    so only an id will do). vocab_size > 0: the id must be below it.
    ValueError saying what was looked for."""
    # An id may come with spaces around it; a token's text is taken as written (" the" is not "the").
    text = mask_token if mask_token.strip() else ""
    if text.strip().isdigit():
        token_id = int(text)
    else:
        if tokenizer_dir is None:
            raise ValueError(f"the mask token {mask_token!r} needs a tokenizer to look it up, and the data has "
                             f"none (no tokenizer.json beside the token files): give the mask token's id"
                             if text else "denoising needs a mask token and the data has no tokenizer (no "
                             "tokenizer.json beside the token files): give the mask token's id (data.mask_token)")
        tokenizer = load_tokenizer(tokenizer_dir)
        candidates = [text] if text else [_configured_token(tokenizer_file(tokenizer_dir), "mask_token")]
        candidates = [token for token in candidates if token] or list(_KNOWN_MASKS)
        ids = [tokenizer.token_to_id(token) for token in candidates]
        found = [token_id for token_id in ids if token_id is not None]
        if not found:
            if text:
                raise ValueError(f"mask token {text!r} is not in the vocabulary of the tokenizer in {tokenizer_dir}")
            raise ValueError(f"the tokenizer in {tokenizer_dir} has no mask token (no mask_token in its "
                             f"tokenizer_config.json, none of {', '.join(_KNOWN_MASKS)} in its vocabulary): give "
                             f"one, as an id or the text of a token (data.mask_token)")
        token_id = found[0]
    if vocab_size and token_id >= vocab_size:
        raise ValueError(f"mask token id {token_id} is outside the model's vocabulary [0, {vocab_size})")
    return token_id


def bos_prefix(tokenizer: Tokenizer) -> List[int]:
    """The ids the tokenizer's post-processor puts before a text when it
    adds its special tokens (a Llama tokenizer's BOS; none for most), as
    ``tokenizer(text)`` in transformers does: nanoq tokenize starts each
    document with them, as generate's prompts start."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def find_eos_id(tokenizer: Tokenizer, eos_token: Optional[str] = None, source: str = "") -> int:
    """Id of the end-of-sequence token: ``eos_token`` if given, else the one
    named by a tokenizer_config.json next to ``source``, else the first of
    ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|im_end|>``,
    ``<|eot_id|>`` in the vocabulary. ValueError if there is none."""
    candidates = [eos_token] if eos_token else []
    if not candidates and source:
        configured = _configured_eos(tokenizer_file(source))
        candidates = [configured] if configured else []
    candidates = candidates or list(_KNOWN_EOS)
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    named = f"tokenizer {source!r}" if source else "the tokenizer"
    if eos_token:
        raise ValueError(f"EOS token {eos_token!r} is not in the vocabulary of {named}")
    raise ValueError(f"cannot tell the end-of-sequence token of {named}: none of "
                     f"{', '.join(_KNOWN_EOS)} is in its vocabulary; pass --eos-token")


def eos_id_or_none(tokenizer: Tokenizer, source: str = "") -> Optional[int]:
    """find_eos_id(tokenizer, source=source), or None when the tokenizer has
    no end-of-sequence token (generation then stops only at its length)."""
    try:
        return find_eos_id(tokenizer, source=source)
    except ValueError:
        return None


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE (GPT-2 style, no prefix space) on ``texts``.

    The vocabulary holds the 256 byte symbols, the special tokens
    (``<|endoftext|>`` = 0, ``<|system|>``, ``<|user|>``, ``<|assistant|>``)
    and merges up to ``vocab_size`` entries; a small corpus may yield fewer.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_TRAINED_VOCAB:
        raise ValueError(f"vocab size must be an integer >= {MIN_TRAINED_VOCAB} (256 bytes + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")
    if vocab_size > _MAX_TRAINED_VOCAB:
        raise ValueError(f"vocab size must be at most {_MAX_TRAINED_VOCAB} to train a tokenizer (the BPE "
                         f"trainer sizes its tables by it before reading any text), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """The vocabulary a model needs for the tokenizer's ids: its highest id
    + 1 (added tokens included), not its number of entries, which is
    smaller when some ids are unused (a reserved range, say)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def write_tokenizer_config(path: str, eos_token: str, chat_template: Optional[str] = None) -> None:
    """A tokenizer_config.json that lets transformers' AutoTokenizer load the
    tokenizer.json beside it and know its EOS token (and, given one, its
    Jinja chat template)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "model_max_length": 1_000_000}
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(path, config)


def set_chat_template(path: str, chat_template: str) -> None:
    """Sets ``chat_template`` in the tokenizer_config.json at ``path`` (whose
    other keys stay), replacing the one it had."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    config["chat_template"] = chat_template
    _write_json(path, config)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
