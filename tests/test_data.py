"""nanoq.data: token files (format, atomic writes, validation) and the loaders
(windows, masking, shuffling, resume, mixtures, curricula). CPU only, tiny files."""

import json
import os
import struct

import numpy as np
import pytest

from nanoq.data import (
    IGNORE_INDEX,
    Curriculum,
    DataLoader,
    Dataset,
    EvalLoader,
    MixtureLoader,
    TokenFile,
    write_token_shards,
    write_tokens,
)

VOCAB = 1000


def ascending_file(directory, name, first, count, vocab=VOCAB, mask=None):
    """A token file holding first, first + 1, ...: every token names its own position."""
    path = str(directory / name)
    write_tokens(path, np.arange(first, first + count), vocab, mask=mask)
    return path


def llmq_header(count, vocab, has_mask, version=2, bytes_per_token=4, magic=b"BIN.TOK\n"):
    """The 1024-byte header as llm.q's tokenizer writes it, built without nanoq."""
    header = magic + struct.pack("<5i", version, bytes_per_token, count, vocab, has_mask)
    return header + bytes(1024 - len(header))


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for k, ((ia, ta), (ib, tb)) in enumerate(zip(a, b)):
        assert np.array_equal(ia, ib) and np.array_equal(ta, tb), f"batch {k} differs"


# --------------------------------------------------------------------------
# Token files
# --------------------------------------------------------------------------


def test_round_trip_without_mask(tmp_path):
    tokens = np.array([5, 0, 999, 17, 42, 3, 3], dtype=np.int64)
    path = tmp_path / "plain.bin"
    write_tokens(path, tokens, vocab_size=1000)
    assert os.path.getsize(path) == 1024 + 4 * 7
    f = TokenFile(path)
    assert len(f) == 7 and f.vocab_size == 1000 and f.version == 2 and not f.has_mask
    assert f.tokens.dtype == np.int32
    assert f.tokens.tolist() == [5, 0, 999, 17, 42, 3, 3]
    assert f.mask is None and f.mask_range(0, 3) is None


def test_round_trip_with_mask(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=21)
    mask = rng.random(21) < 0.5
    path = tmp_path / "masked.bin"
    write_tokens(path, tokens, vocab_size=50, mask=mask)
    assert os.path.getsize(path) == 1024 + 4 * 21 + 3  # ceil(21 / 8) mask bytes
    f = TokenFile(path)
    assert f.has_mask and np.array_equal(f.tokens, tokens)
    assert f.mask.dtype == np.bool_ and f.mask.tolist() == mask.tolist()
    for start, stop in [(0, 21), (3, 11), (8, 16), (7, 8), (20, 21), (5, 5)]:
        assert f.mask_range(start, stop).tolist() == mask[start:stop].tolist(), (start, stop)


def test_header_is_byte_identical_to_the_llmq_layout(tmp_path):
    path = tmp_path / "h.bin"
    write_tokens(path, [1, 2, 3], vocab_size=32000, mask=np.array([True, False, True]))
    data = path.read_bytes()
    assert data[:1024] == llmq_header(count=3, vocab=32000, has_mask=1)
    assert data[1024:1036] == struct.pack("<3i", 1, 2, 3)
    assert data[1036:] == bytes([0b101])


def test_reads_a_file_built_byte_by_byte_like_llmq(tmp_path):
    tokens = [7, 300, 0, 12, 299, 1, 2, 3, 4, 5]
    train_on = [1, 0, 0, 1, 1, 1, 0, 1, 0, 1]
    mask_bytes = bytearray(2)
    for i, bit in enumerate(train_on):
        mask_bytes[i // 8] |= bit << (i % 8)
    path = tmp_path / "llmq.bin"
    path.write_bytes(llmq_header(len(tokens), 301, 1) + struct.pack(f"<{len(tokens)}i", *tokens) + bytes(mask_bytes))
    f = TokenFile(path)
    assert f.tokens.tolist() == tokens
    assert f.mask.tolist() == [bool(b) for b in train_on]
    assert f.vocab_size == 301 and f.version == 2 and len(f) == 10


def test_document_starts_follow_the_mask_where_llmq_reads_nothing(tmp_path):
    # llm.q's reader takes header words 2-6, the tokens and the mask at their
    # offsets and never the file's size: all of that is as without starts.
    path = tmp_path / "docs.bin"
    write_tokens(path, [1, 2, 3], vocab_size=32000, mask=np.array([True, False, True]), document_starts=[0, 2])
    data = path.read_bytes()
    assert data[:28] == llmq_header(count=3, vocab=32000, has_mask=1)[:28]
    assert data[28:36] == b"DOCS" + struct.pack("<i", 2) and data[36:1024] == bytes(988)
    assert data[1024:1037] == struct.pack("<3i", 1, 2, 3) + bytes([0b101])
    assert data[1037:] == struct.pack("<2i", 0, 2)
    f = TokenFile(path)
    assert f.document_starts.tolist() == [0, 2] and f.mask.tolist() == [True, False, True]
    write_tokens(tmp_path / "none.bin", [], 5, document_starts=[])
    assert TokenFile(tmp_path / "none.bin").document_starts.tolist() == []
    write_tokens(tmp_path / "plain.bin", [1, 2, 3], vocab_size=10)
    assert TokenFile(tmp_path / "plain.bin").document_starts is None


def test_a_token_file_into_a_folder_that_is_not_there_names_the_folder(tmp_path):
    # The error named the temporary file ("No such file or directory: 'data/train.bin.tmp-8428'").
    with pytest.raises(FileNotFoundError, match=r"no folder '.*missing' to write the token file into \(make it "
                                                r"first: os\.makedirs\)"):
        write_tokens(tmp_path / "missing" / "train.bin", [1, 2, 3], 10)
    assert os.listdir(tmp_path) == []


def test_a_header_padded_like_llmq_tokenizer_records_no_document_starts(tmp_path):
    # llm.q's tokenizer reserves the header as "*" * 1023 + "\n" and writes words 0-6 over it.
    header = bytearray(b"*" * 1023 + b"\n")
    header[:28] = llmq_header(3, 10, 0)[:28]
    path = tmp_path / "llmq.bin"
    path.write_bytes(bytes(header) + struct.pack("<3i", 4, 0, 5))
    f = TokenFile(path)
    assert f.tokens.tolist() == [4, 0, 5] and f.document_starts is None


@pytest.mark.parametrize("starts, message", [
    ([1, 2], "first document start must be 0"),
    ([0, 2, 2], r"document start 2 at document_starts\[2\] does not come after 2"),
    ([0, 4], r"document start 4 at document_starts\[1\] is past the last token \(index 3\)"),
    ([], "first document start must be 0.*got none"),
])
def test_bad_document_starts_are_refused_by_the_writer_and_the_reader(tmp_path, starts, message):
    with pytest.raises(ValueError, match=message):
        write_tokens(tmp_path / "w.bin", [1, 2, 3, 4], vocab_size=10, document_starts=starts)
    assert os.listdir(tmp_path) == []
    header = bytearray(llmq_header(4, 10, 0))
    header[28:36] = b"DOCS" + struct.pack("<i", len(starts))
    path = tmp_path / "corrupt.bin"
    path.write_bytes(bytes(header) + struct.pack("<4i", 1, 2, 3, 4) + struct.pack(f"<{len(starts)}i", *starts))
    with pytest.raises(ValueError, match=f"corrupt\\.bin.*{message}.*corrupt"):
        TokenFile(path)


def test_shards_end_between_documents_and_only_a_longer_document_is_split(tmp_path):
    # Documents [0, 2), [2, 3), [3, 9), [9, 10) in shards of at most 4 tokens:
    # [0, 3) two whole documents; [3, 9) is longer than a shard: [3, 7) and
    # [7, 10), whose piece of it counts as a document of its own.
    mask = np.arange(10) % 3 != 0
    paths = write_token_shards(tmp_path / "t", np.arange(10), 10, mask=mask, max_tokens=4,
                               document_starts=[0, 2, 3, 9])
    files = [TokenFile(p) for p in paths]
    assert [f.tokens.tolist() for f in files] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert [f.document_starts.tolist() for f in files] == [[0, 2], [0], [0, 2]]
    assert [f.mask.tolist() for f in files] == [mask[0:3].tolist(), mask[3:7].tolist(), mask[7:].tolist()]
    paths = write_token_shards(tmp_path / "exact", np.arange(8), 8, max_tokens=4, document_starts=[0, 4])
    assert [TokenFile(p).document_starts.tolist() for p in paths] == [[0], [0]]


def test_shards_split_at_max_tokens(tmp_path):
    tokens = np.arange(10)
    mask = np.arange(10) % 3 != 0
    paths = write_token_shards(tmp_path / "train", tokens, 10, mask=mask, max_tokens=4)
    assert [os.path.basename(p) for p in paths] == ["train_000000.bin", "train_000001.bin", "train_000002.bin"]
    files = [TokenFile(p) for p in paths]
    assert [f.tokens.tolist() for f in files] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [f.mask.tolist() for f in files] == [mask[0:4].tolist(), mask[4:8].tolist(), mask[8:].tolist()]


def test_shards_of_an_exact_multiple_and_of_nothing(tmp_path):
    paths = write_token_shards(tmp_path / "even", np.arange(8), 8, max_tokens=4)
    assert [len(TokenFile(p)) for p in paths] == [4, 4]
    paths = write_token_shards(tmp_path / "none", np.zeros(0, dtype=np.int32), 8, max_tokens=4)
    assert [len(TokenFile(p)) for p in paths] == [0]


def test_shards_validate_every_token_before_writing_any(tmp_path):
    with pytest.raises(ValueError, match=r"token id 8 outside \[0, 8\) at tokens\[6\]"):
        write_token_shards(tmp_path / "s", [0, 1, 2, 3, 4, 5, 8], 8, max_tokens=2)
    assert os.listdir(tmp_path) == []


def test_bad_token_is_rejected_and_leaves_no_file(tmp_path):
    path = tmp_path / "bad.bin"
    with pytest.raises(ValueError, match=r"token id 1000 outside \[0, 1000\) at tokens\[2\]"):
        write_tokens(path, [1, 2, 1000, 4, -1], vocab_size=1000)
    with pytest.raises(ValueError, match=r"token id -1 outside \[0, 1000\) at tokens\[1\]"):
        write_tokens(path, [1, -1], vocab_size=1000)
    assert os.listdir(tmp_path) == []


def test_bad_writer_arguments_are_rejected(tmp_path):
    path = tmp_path / "x.bin"
    with pytest.raises(TypeError, match="integer array"):
        write_tokens(path, [1.5, 2.0], vocab_size=10)
    with pytest.raises(ValueError, match="1-D"):
        write_tokens(path, [[1, 2]], vocab_size=10)
    with pytest.raises(TypeError, match="bool array"):
        write_tokens(path, [1, 2], vocab_size=10, mask=[1, 0])
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        write_tokens(path, [1, 2], vocab_size=10, mask=[True])
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokens(path, [1, 2], vocab_size=0)
    with pytest.raises(ValueError, match="max_tokens"):
        write_token_shards(tmp_path / "s", [1, 2], 10, max_tokens=0)
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    write_tokens(path, [1, 2, 3], vocab_size=10)
    before = path.read_bytes()

    def disk_failure(fd):
        raise OSError("simulated disk failure")

    monkeypatch.setattr(os, "fsync", disk_failure)
    with pytest.raises(OSError, match="simulated"):
        write_tokens(path, np.arange(500), vocab_size=1000)
    assert os.listdir(tmp_path) == ["data.bin"]
    assert path.read_bytes() == before


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.bin"):
        TokenFile(tmp_path / "nowhere.bin")
    with pytest.raises(FileNotFoundError, match="nowhere.bin"):
        Dataset([str(tmp_path / "nowhere.bin")], seq_len=4)


def test_truncated_file_names_file_and_sizes(tmp_path):
    path = ascending_file(tmp_path, "cut.bin", 0, 100)
    with open(path, "r+b") as f:
        f.truncate(1024 + 4 * 100 - 6)
    with pytest.raises(ValueError, match=r"cut\.bin.* is 1418 bytes .*exactly 1424 bytes.*truncated"):
        TokenFile(path)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"cut\.bin.* is 100 bytes, shorter than the 1024-byte header"):
        TokenFile(path)


def test_truncated_mask_is_detected(tmp_path):
    path = ascending_file(tmp_path, "m.bin", 0, 20, mask=np.ones(20, dtype=bool))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(ValueError, match=r"m\.bin.*with mask.*truncated"):
        TokenFile(path)


@pytest.mark.parametrize(
    "header, message",
    [
        (llmq_header(2, 10, 0, magic=b"BIN.TOX\n"), r"wrong magic b'BIN\.TOX\\n'.*not a token file: `nanoq "
                                                     r"tokenize` makes them.*nanoq\.data\.write_tokens\(path, "
                                                     r"tokens, vocab_size\) from a token array"),
        (llmq_header(2, 10, 0, version=1), r"format version 1; only version 2 is supported \(an older llm.q's, "
                                           r"with no vocabulary size in its header: tokenize its text again"),
        (llmq_header(2, 10, 0, bytes_per_token=2), "2 bytes per token; only 4"),
        (llmq_header(2, 10, 2), "has-mask word 2"),
        (llmq_header(2, 0, 0), "vocab size 0"),
        (llmq_header(-2, 10, 0), "negative token count -2"),
    ],
    ids=["magic", "version", "bytes_per_token", "has_mask", "vocab", "count"],
)
def test_bad_header_is_named(tmp_path, header, message):
    path = tmp_path / "bad_header.bin"
    path.write_bytes(header + struct.pack("<2i", 1, 2))
    with pytest.raises(ValueError, match=message) as error:
        TokenFile(path)
    assert "bad_header.bin" in str(error.value)


def test_token_beyond_the_models_vocab_is_named_and_a_negative_one_at_open(tmp_path):
    path = tmp_path / "corrupt.bin"
    path.write_bytes(llmq_header(4, 10, 0) + struct.pack("<4i", 1, 2, 10, 3))
    token_file = TokenFile(path)  # past the header's vocab: llm.q does that for an added EOS
    assert token_file.max_token == 10
    token_file.check_vocab(11)
    with pytest.raises(ValueError, match=r"corrupt\.bin.*token id 10 at index 2 is outside the vocabulary of "
                                         r"the model \(10 ids, \[0, 10\)\)"):
        token_file.check_vocab(10)
    path.write_bytes(llmq_header(4, 10, 0) + struct.pack("<4i", 1, -7, 0, 3))
    with pytest.raises(ValueError, match=r"token id -7 at index 1"):
        Dataset(str(path), seq_len=1)


# --------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------


def test_windows_never_cross_files_and_tails_are_dropped(tmp_path):
    # Windows of 5 tokens stepping by 4: [0, 5) and [4, 9); the tail [9, 10] is too short for [8, 13).
    a = ascending_file(tmp_path, "a.bin", 0, 11)
    b = ascending_file(tmp_path, "b.bin", 100, 5)      # 1 window
    dataset = Dataset([a, b], seq_len=4)
    assert len(dataset) == 3
    inputs, targets = dataset.read_windows([0, 1, 2])
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [100, 101, 102, 103]]
    assert targets.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [101, 102, 103, 104]]
    assert inputs.dtype == targets.dtype == np.int32
    assert inputs.flags.c_contiguous and targets.flags.c_contiguous


def test_masked_tokens_become_ignored_targets(tmp_path):
    mask = np.ones(10, dtype=bool)
    mask[[0, 2, 5, 9]] = False  # 0 is only ever an input and 9 in the dropped tail: their bits do not matter
    path = ascending_file(tmp_path, "m.bin", 0, 10, mask=mask)
    inputs, targets = Dataset(path, seq_len=4).read_windows([0, 1])  # tokens [0, 5) and [4, 9)
    assert inputs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a mask bit hides a target, never an input
    assert targets.tolist() == [[1, IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 6, 7, 8]]


def test_globs_expand_sorted_and_vocab_is_the_largest(tmp_path):
    ascending_file(tmp_path, "s_1.bin", 10, 3, vocab=50)
    ascending_file(tmp_path, "s_0.bin", 0, 3, vocab=20)
    dataset = Dataset(str(tmp_path / "s_*.bin"), seq_len=2)
    assert [os.path.basename(f.path) for f in dataset.files] == ["s_0.bin", "s_1.bin"]
    assert dataset.vocab_size == 50
    assert dataset.read_windows([0, 1])[0].tolist() == [[0, 1], [10, 11]]


def test_glob_matching_nothing_is_named(tmp_path):
    ascending_file(tmp_path, "a.bin", 0, 10)
    with pytest.raises(ValueError, match=r"glob '.*val_\*\.bin' matches no files"):
        Dataset([str(tmp_path / "a.bin"), str(tmp_path / "val_*.bin")], seq_len=4)


def test_dataset_without_a_full_window_is_rejected(tmp_path):
    path = ascending_file(tmp_path, "short.bin", 0, 4)
    with pytest.raises(ValueError, match=r"no complete window of seq_len \+ 1 = 5 tokens in .*short\.bin.*4 tokens"):
        Dataset(path, seq_len=4)
    # Many short files (tiny shards): windows do not span files; the error names a few and counts the rest.
    paths = [ascending_file(tmp_path, f"s{i}.bin", 0, 4) for i in range(5)]
    with pytest.raises(ValueError, match=r"in '.*s0\.bin', '.*s1\.bin', '.*s2\.bin' and 2 more files \(20 tokens "
                                         r"in all; windows do not span files\)$"):
        Dataset(paths, seq_len=4)


def test_bad_dataset_arguments_are_rejected(tmp_path):
    path = ascending_file(tmp_path, "a.bin", 0, 10)
    with pytest.raises(ValueError, match="listed more than once"):
        Dataset([path, str(tmp_path / "*.bin")], seq_len=4)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        Dataset(path, seq_len=0)
    with pytest.raises(ValueError, match="no token files"):
        Dataset([], seq_len=4)


# --------------------------------------------------------------------------
# DataLoader
# --------------------------------------------------------------------------


def test_loaders_refuse_files_or_anything_but_a_dataset_with_a_type_error_saying_how_to_make_one(tmp_path):
    ascending_file(tmp_path, "train_0.bin", 0, 20)
    glob_ = str(tmp_path / "train_*.bin")
    for loader, arguments in ((DataLoader, dict(batch_rows=2, seed=0)), (EvalLoader, dict(batch_rows=2))):
        name = loader.__name__
        with pytest.raises(TypeError, match=rf"^{name} takes a nanoq\.data\.Dataset as its dataset, got str; make "
                                            rf"one from the files: {name}\(Dataset\('.*train_\*\.bin', seq_len="
                                            rf"\.\.\.\), \.\.\.\)$"):
            loader(glob_, **arguments)
        with pytest.raises(TypeError, match=rf"^{name} takes a nanoq\.data\.Dataset as its dataset, got dict "
                                            rf"\(nanoq\.data\.Dataset\(paths_or_globs, seq_len\) makes one"):
            loader({"seq_len": 4}, **arguments)
        assert loader(Dataset(glob_, seq_len=4), **arguments).seq_len == 4


@pytest.fixture
def two_files(tmp_path):
    """13 windows of seq_len 4 (5 tokens, stepping by 4) in two files, 8 and 5 of
    them (the first with a 2-token tail); a window is named by its first token."""
    ascending_file(tmp_path, "train_0.bin", 0, 8 * 4 + 1 + 2)
    ascending_file(tmp_path, "train_1.bin", 500, 5 * 4 + 1)
    return Dataset(str(tmp_path / "train_*.bin"), seq_len=4)


def window_starts(dataset):
    inputs, _ = dataset.read_windows(np.arange(len(dataset)))
    return sorted(inputs[:, 0].tolist())


def test_same_seed_same_batches_other_seed_other_batches(two_files):
    first = take(DataLoader(two_files, batch_rows=4, seed=7), 6)
    again = take(DataLoader(two_files, batch_rows=4, seed=7), 6)
    other = take(DataLoader(two_files, batch_rows=4, seed=8), 6)
    assert_same_batches(first, again)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(first, other))


def test_every_window_once_per_epoch_with_files_shuffled_together(two_files):
    loader = DataLoader(two_files, batch_rows=4, seed=3)
    batches = take(loader, 13)  # 52 rows = 4 epochs of 13 windows exactly
    assert loader.epoch == 4 and loader.position == 0
    rows = np.concatenate([inputs for inputs, _ in batches])
    for inputs, targets in batches:
        assert np.array_equal(targets[:, :-1], inputs[:, 1:])
    epochs = [rows[13 * e:13 * (e + 1), 0].tolist() for e in range(4)]
    for order in epochs:
        assert sorted(order) == window_starts(two_files)
    assert epochs[0] != epochs[1]
    # Files are interleaved, not visited one after the other.
    from_second_file = [start >= 500 for start in epochs[0]]
    assert from_second_file != sorted(from_second_file) and from_second_file != sorted(from_second_file, reverse=True)


def test_batch_spanning_an_epoch_boundary(two_files):
    loader = DataLoader(two_files, batch_rows=5, seed=0)
    take(loader, 2)
    assert (loader.epoch, loader.position) == (0, 10)
    inputs, _ = loader.next_batch()  # 3 windows from epoch 0, 2 from epoch 1
    assert (loader.epoch, loader.position) == (1, 2)
    order0 = np.random.default_rng([0, 0]).permutation(13)
    order1 = np.random.default_rng([0, 1]).permutation(13)
    expected = two_files.read_windows(np.concatenate([order0[10:], order1[:2]]))[0]
    assert np.array_equal(inputs, expected)


def test_two_devices_get_the_same_global_batch_as_one(two_files):
    one = take(DataLoader(two_files, batch_rows=4, seed=11, devices=1), 5)
    two_loader = DataLoader(two_files, batch_rows=4, seed=11, devices=2)
    assert two_loader.rows_per_device == 2
    assert_same_batches(one, take(two_loader, 5))
    with pytest.raises(ValueError, match="batch_rows 5 is not divisible by devices 2"):
        DataLoader(two_files, batch_rows=5, seed=0, devices=2)


def test_resume_serves_exactly_the_next_batches(two_files):
    loader = DataLoader(two_files, batch_rows=3, seed=5)
    take(loader, 7)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = take(loader, 5)
    resumed = DataLoader(two_files, batch_rows=3, seed=5)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (1, 8)
    assert_same_batches(take(resumed, 5), expected)


def test_state_from_another_dataset_or_seed_is_rejected(tmp_path, two_files):
    state = DataLoader(two_files, batch_rows=2, seed=1).state_dict()
    other = Dataset(ascending_file(tmp_path, "other.bin", 0, 100), seq_len=4)
    with pytest.raises(ValueError, match="different dataset"):
        DataLoader(other, batch_rows=2, seed=1).load_state_dict(state)
    longer_windows = Dataset(str(tmp_path / "train_*.bin"), seq_len=3)
    with pytest.raises(ValueError, match="different dataset"):
        DataLoader(longer_windows, batch_rows=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with seed 1, this loader has seed 2"):
        DataLoader(two_files, batch_rows=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not a DataLoader state"):
        DataLoader(two_files, batch_rows=2, seed=1).load_state_dict({"kind": "MixtureLoader"})
    with pytest.raises(ValueError, match="invalid epoch"):
        DataLoader(two_files, batch_rows=2, seed=1).load_state_dict(dict(state, position=13))


# --------------------------------------------------------------------------
# EvalLoader
# --------------------------------------------------------------------------


def test_eval_is_in_order_and_pads_the_last_batch(two_files):
    loader = EvalLoader(two_files, batch_rows=5)
    assert len(loader) == 3
    batches = list(loader)
    assert len(batches) == 3
    starts = [row for inputs, _ in batches[:2] for row in inputs[:, 0].tolist()]
    assert starts == [0, 4, 8, 12, 16, 20, 24, 28, 500, 504]
    inputs, targets = batches[2]
    assert inputs.shape == targets.shape == (5, 4)
    assert inputs[:3, 0].tolist() == [508, 512, 516]
    assert targets[2].tolist() == [517, 518, 519, 520]
    assert np.all(inputs[3:] == 0) and np.all(targets[3:] == IGNORE_INDEX)
    assert_same_batches(list(loader), batches)  # re-iterable


# --------------------------------------------------------------------------
# MixtureLoader
# --------------------------------------------------------------------------


@pytest.fixture
def two_sources(tmp_path):
    """Two datasets of seq_len 4: source A (40 windows) tokens < 500, source B (30 windows) tokens >= 500."""
    a = Dataset(ascending_file(tmp_path, "a.bin", 0, 4 * 40 + 1), seq_len=4)
    b = Dataset(ascending_file(tmp_path, "b.bin", 500, 4 * 30 + 1), seq_len=4)
    return a, b


def mixture(sources, seed=0, weights=(3.0, 1.0)):
    a, b = sources
    return MixtureLoader([(DataLoader(a, 2, seed=1), weights[0]), (DataLoader(b, 2, seed=2), weights[1])], seed=seed)


def test_mixture_follows_the_weights(two_sources):
    loader = mixture(two_sources)
    from_b = [int(loader.next_batch()[0][0, 0] >= 500) for _ in range(2000)]
    share_b = sum(from_b) / 2000
    assert abs(share_b - 0.25) < 0.03, share_b
    # Only the chosen loader advances: each sub-loader served exactly its batches.
    a_state, b_state = (sub.state_dict() for sub in loader.loaders)
    assert a_state["epoch"] * 40 + a_state["position"] == 2 * (2000 - sum(from_b))
    assert b_state["epoch"] * 30 + b_state["position"] == 2 * sum(from_b)
    assert loader.draws == 2000


def test_mixture_resume_is_exact(two_sources):
    loader = mixture(two_sources, seed=4)
    take(loader, 37)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = take(loader, 20)
    resumed = mixture(two_sources, seed=4)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 20), expected)


def test_mixture_rejects_mismatched_state_and_shapes(two_sources):
    state = mixture(two_sources).state_dict()
    with pytest.raises(ValueError, match="weights"):
        mixture(two_sources, weights=(1.0, 1.0)).load_state_dict(state)
    a, b = two_sources
    with pytest.raises(ValueError, match="one batch shape"):
        MixtureLoader([(DataLoader(a, 2, seed=0), 1.0), (DataLoader(b, 4, seed=0), 1.0)], seed=0)
    with pytest.raises(ValueError, match="weight of loader 1"):
        MixtureLoader([(DataLoader(a, 2, seed=0), 1.0), (DataLoader(b, 2, seed=0), 0.0)], seed=0)


def test_mixture_weights_whose_sum_overflows_are_refused_and_large_ones_that_fit_mix(two_sources):
    with pytest.raises(ValueError, match=r"weights \[1e\+308, 1e\+308\] of a mixture sum past the largest float"):
        mixture(two_sources, weights=(1e308, 1e308))
    loader = mixture(two_sources, weights=(1e307, 1e307))  # equal: half the batches from each
    from_b = sum(int(loader.next_batch()[0][0, 0] >= 500) for _ in range(400))
    assert 160 < from_b < 240, from_b


def test_rejected_mixture_state_leaves_the_loaders_untouched(two_sources):
    loader = mixture(two_sources)
    take(loader, 3)
    before = loader.state_dict()
    broken = json.loads(json.dumps(before))
    broken["loaders"][0]["position"] = 7  # valid for A
    broken["loaders"][1]["dataset"]["sha256"] = "0" * 32  # but B is from another dataset
    with pytest.raises(ValueError, match="different dataset"):
        loader.load_state_dict(broken)
    assert loader.state_dict() == before


# --------------------------------------------------------------------------
# Curriculum
# --------------------------------------------------------------------------


def build_curriculum(sources, batches_per_step=2):
    a, b = sources
    return Curriculum(
        [(DataLoader(a, 2, seed=0), EvalLoader(a, 2), 3), (DataLoader(b, 2, seed=0), None, 2)],
        batches_per_step=batches_per_step,
    )


def test_curriculum_runs_stages_in_order(two_sources):
    curriculum = build_curriculum(two_sources)
    assert curriculum.total_steps == 5 and curriculum.current_stage == 0
    sources = []
    for _ in range(6):  # stage 0: 3 steps of 2 batches
        sources.append("b" if curriculum.next_batch()[0][0, 0] >= 500 else "a")
    assert curriculum.current_stage == 0 and curriculum.stage_complete
    assert isinstance(curriculum.eval_loader(), EvalLoader)  # still stage 0's, for its final eval
    for _ in range(4):
        sources.append("b" if curriculum.next_batch()[0][0, 0] >= 500 else "a")
    assert sources == ["a"] * 6 + ["b"] * 4
    assert curriculum.current_stage == 1 and curriculum.eval_loader() is None and curriculum.finished
    with pytest.raises(StopIteration):
        curriculum.next_batch()
    assert len(list(build_curriculum(two_sources))) == 10


def test_curriculum_resumes_in_the_middle_of_stage_two(two_sources):
    curriculum = build_curriculum(two_sources)
    take(curriculum, 6 + 1)
    state = json.loads(json.dumps(curriculum.state_dict()))
    assert (state["stage"], state["batches_in_stage"]) == (1, 1)
    expected = list(curriculum)
    resumed = build_curriculum(two_sources)
    resumed.load_state_dict(state)
    assert resumed.current_stage == 1
    got = list(resumed)
    assert len(got) == 3
    assert_same_batches(got, expected)


def test_curriculum_state_with_other_stage_lengths_is_rejected(two_sources):
    state = build_curriculum(two_sources).state_dict()
    other = Curriculum([(DataLoader(two_sources[0], 2, seed=0), None, 2), (DataLoader(two_sources[1], 2, seed=0), None, 3)],
                       batches_per_step=2)
    with pytest.raises(ValueError, match=r"stage steps \[3, 2\]; this curriculum has \[2, 3\]"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="steps of curriculum stage 0"):
        Curriculum([(None, None, 0)])


def test_a_curriculum_resumed_with_another_grad_accum_continues_from_the_same_step(two_sources):
    # Two optimizer steps of stage 0 (3 steps) at 2 batches each, then the rest at 1 batch a step:
    # stage 0's last step, then stage 1's 2 steps. The data continues where it stopped.
    curriculum = build_curriculum(two_sources, batches_per_step=2)
    take(curriculum, 4)
    state = json.loads(json.dumps(curriculum.state_dict()))
    expected = take(curriculum, 1)  # the next batch the saving run would have served
    resumed = build_curriculum(two_sources, batches_per_step=1)
    resumed.load_state_dict(state)
    assert (resumed.current_stage, resumed.batches_in_stage) == (0, 2)
    rest = list(resumed)
    assert len(rest) == 1 + 2  # stage 0's last step, stage 1's two, one batch each
    assert_same_batches(rest[:1], expected)
    assert resumed.current_stage == 1 and resumed.finished
    # The saving curriculum is mid-step now (5 batches): another batches_per_step cannot say at which step.
    with pytest.raises(ValueError, match="only a state saved after whole optimizer steps"):
        build_curriculum(two_sources, batches_per_step=1).load_state_dict(curriculum.state_dict())


def test_a_set_of_many_shards_holds_at_most_one_descriptor_per_file(tmp_path):
    # Each file held three mappings (tokens, mask, document starts), each its own descriptor: some
    # 15,000 tiny shards (`nanoq tokenize --shard-tokens 1`) ended training in "Too many open files".
    def open_descriptors():
        return len(os.listdir("/proc/self/fd"))

    rng = np.random.default_rng(0)
    small, large = [], []
    for i in range(40):
        small.append(str(tmp_path / f"small_{i}.bin"))
        tokens = rng.integers(0, 50, 40)
        write_tokens(small[-1], tokens, 50, mask=tokens % 3 > 0, document_starts=[0, 10, 30])
    for i in range(3):  # above the size read into memory: mapped
        large.append(str(tmp_path / f"large_{i}.bin"))
        tokens = rng.integers(0, 50, 40_000)
        write_tokens(large[-1], tokens, 50, mask=tokens % 3 > 0, document_starts=[0, 1000, 30_000])
    before = open_descriptors()
    files = [TokenFile(path) for path in small + large]
    assert open_descriptors() - before == len(large)
    for file, path in zip(files, small + large):  # the views read what was written
        written = np.fromfile(path, dtype="<i4", offset=1024, count=len(file))
        np.testing.assert_array_equal(file.tokens, written)
        np.testing.assert_array_equal(file.mask, written % 3 > 0)
        assert list(file.document_starts) == ([0, 10, 30] if path in small else [0, 1000, 30_000])
        assert not file.tokens.flags.writeable
    dataset = Dataset(small + large, seq_len=8)
    assert open_descriptors() - before <= 2 * len(large)  # (Dataset's own TokenFiles)
    del files, dataset


def test_more_mapped_files_than_the_descriptor_limit_leaves_raise_it_or_say_so(tmp_path):
    # In a child process: a lowered hard limit cannot be raised again.
    import subprocess
    import sys

    paths = []
    for i in range(40):
        paths.append(str(tmp_path / f"shard_{i}.bin"))
        write_tokens(paths[-1], np.arange(20_000) % 50, 50)  # 80 KB: mapped
    child = f"""
import os, resource
from nanoq.data import Dataset
paths = {paths!r}
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
in_use = len(os.listdir("/proc/self/fd"))
# A soft limit the files would pass is raised (towards the hard one) instead of failing mid-way.
resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 10, hard))
dataset = Dataset(paths, seq_len=8)
assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= in_use + 40 and dataset.num_windows > 0
del dataset
# A hard limit they would pass: an error saying so, before any file is opened.
resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 10, in_use + 20))
try:
    Dataset(paths, seq_len=8)
except ValueError as e:
    print(str(e).replace(str(in_use + 20), "LIMIT"))
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("40 token files over 64 KiB, each mapped with a file descriptor, need more than this "
                           "process may open (LIMIT, the hard limit of ulimit -n): tokenize the data into fewer, "
                           "larger files (nanoq tokenize --shard-tokens), or raise the limit\n")
