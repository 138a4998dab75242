"""nanoq.data: token files and the loaders that turn them into training batches.

Token files (.bin) are llm.q's tokenizer output, version 2: a 1024-byte header
(the bytes ``BIN.TOK\\n``, then int32 version 2, bytes per token 4, token count,
vocab size, has-mask), the int32 tokens, and optionally one mask bit per token
(LSB first; 1 = train on it), and, nanoq's addition, where each document starts
(layout in nanoq.data.token_file). ``write_tokens`` writes one atomically,
``write_token_shards`` splits a long stream into numbered shards, ``TokenFile``
memory-maps one and checks it (header, exact size, no negative token; the
ids are checked against the model's vocabulary, which may exceed the
header's: llm.q writes an added EOS token as id = header vocab).

Loaders serve (inputs, targets), int32 C-contiguous [batch_rows, seq_len],
where batch_rows is the global batch (device d takes rows
[d * rows_per_device, (d + 1) * rows_per_device)):

    dataset = Dataset("data/train_*.bin", seq_len=1024)   # windows of seq_len + 1 tokens, every seq_len
    loader = DataLoader(dataset, batch_rows=devices * batch_size, seed=0)
    inputs, targets = loader.next_batch()                 # masked targets are -100
    state = loader.state_dict()                           # small, JSON-serialisable
    loader.load_state_dict(state)                         # resumes exactly

Under a launcher, process p of P passes ``part=(p, P)`` (and the world's
devices) to serve and read only its rows of every global batch.

- DataLoader: endless; each epoch is a seeded permutation of all windows of all
  files; batches are consecutive slices of the epoch stream (one may span two
  epochs); the same seed gives the same global batches for any device count.
- EvalLoader: one in-order pass; the last batch is padded (inputs 0, targets -100).
- MixtureLoader: each batch comes whole from one loader, chosen by weight.
- Curriculum: stages (train loader, eval loader or None, optimizer steps) in order.
"""
from nanoq.data.loader import IGNORE_INDEX, DataLoader, Dataset, EvalLoader
from nanoq.data.mixing import Curriculum, MixtureLoader
from nanoq.data.token_file import TokenFile, write_token_shards, write_tokens

__all__ = [
    "Curriculum",
    "DataLoader",
    "Dataset",
    "EvalLoader",
    "IGNORE_INDEX",
    "MixtureLoader",
    "TokenFile",
    "write_token_shards",
    "write_tokens",
]
