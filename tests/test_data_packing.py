"""Dataset(packing="pack"): whole documents per window, with positions.

Each check reads the documents back from the token file by its EOS tokens
(independently of the packing code) and compares: every document of two or
more tokens is in exactly one window, whole (or, longer than a window, in
pieces of seq_len), its positions restart at 0, the rest of a window is
ignored padding; resuming and parts serve exactly what one uninterrupted
loader serves.
"""
import json
import warnings
from collections import Counter

import numpy as np
import pytest

from nanoq.data import DataLoader, Dataset, EvalLoader, TokenFile, write_tokens
from nanoq.data.loader import default_packing

EOS = 1
VOCAB = 50
SEQ = 12


def write_documents(path, lengths, seed=0, with_summary=True):
    """A token file of documents of `lengths` tokens (the last of each EOS)
    and a mask with random zeros; returns the documents' token arrays."""
    rng = np.random.default_rng(seed)
    documents = [np.append(rng.integers(2, VOCAB, n - 1), EOS).astype(np.int32) for n in lengths]
    tokens = np.concatenate(documents)
    mask = rng.random(tokens.size) < 0.8
    write_tokens(path, tokens, VOCAB, mask=mask)
    if with_summary:
        (path.parent / "tokenize.json").write_text(json.dumps({"eos_id": EOS, "packing": "pack"}))
    return documents, tokens, mask


def split_rows(inputs, targets, positions):
    """The (inputs, targets) of each document of each row, cut where positions are 0."""
    pieces = []
    for row in range(len(inputs)):
        starts = list(np.flatnonzero(positions[row] == 0)) + [positions.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            pieces.append((inputs[row, a:b], targets[row, a:b]))
            assert np.array_equal(positions[row, a:b], np.arange(b - a)), "positions restart per document"
    return pieces


LENGTHS = [5, 3, 9, 2, 13, 4, 7, 1, 6, 11, 8, 3, 10, 5]  # 13 tokens: 12 positions, exactly a window


def test_pack_keeps_every_document_whole_in_one_window(tmp_path):
    documents, tokens, mask = write_documents(tmp_path / "sft.bin", LENGTHS)
    dataset = Dataset(tmp_path / "sft.bin", SEQ, packing="pack")
    inputs, targets, positions = dataset.read_windows(np.arange(dataset.num_windows))
    assert inputs.shape == targets.shape == positions.shape == (dataset.num_windows, SEQ)
    expected = Counter()
    offset = 0
    for doc in documents:
        doc_mask = mask[offset:offset + doc.size]
        offset += doc.size
        if doc.size >= 2:
            expected[(tuple(doc[:-1]), tuple(np.where(doc_mask[1:], doc[1:], -100)))] += 1
    got = Counter()
    for x, y in split_rows(inputs, targets, positions):
        if (y == -100).all() and len(x) == 1 and x[0] == 0:
            continue  # a padding token
        got[(tuple(x), tuple(y))] += 1
    assert got == expected
    # Windows are filled in order and no document is split: a window ends
    # only where the next document does not fit.
    # (Real tokens are >= 1, so input 0 is padding.)
    used = (inputs != 0).sum(1)
    first_document = [int(np.flatnonzero(np.append(p[1:], 0) == 0)[0]) + 1 for p in positions]
    assert all(used[w] + first_document[w + 1] > SEQ for w in range(len(used) - 1))
    assert (inputs[np.arange(SEQ)[None, :] >= used[:, None]] == 0).all()  # padding only at the end
    # Positions per document 4 2 8 1 12 3 6 - 5 10 7 2 9 4 pack greedily as
    # 4+2 | 8+1 | 12 | 3+6 | 5 | 10 | 7+2 | 9 | 4 (a 1-token document has none).
    assert dataset.num_windows == 9


def test_a_document_longer_than_a_window_is_cut_into_restarting_pieces_with_a_warning(tmp_path):
    documents, tokens, _ = write_documents(tmp_path / "long.bin", [4, 30, 3])
    with pytest.warns(UserWarning, match="1 document"):
        dataset = Dataset(tmp_path / "long.bin", SEQ, packing="pack")
    inputs, targets, positions = dataset.read_windows(np.arange(dataset.num_windows))
    pieces = [x for x, _ in split_rows(inputs, targets, positions) if len(x) > 1 or x[0] != 0]
    long = documents[1]
    assert [len(p) for p in pieces] == [3, 12, 12, 5, 2]
    assert np.array_equal(np.concatenate(pieces[1:4]), long[:-1])


def test_resume_is_exact_and_parts_are_disjoint(tmp_path):
    write_documents(tmp_path / "a.bin", LENGTHS * 3, seed=1)
    dataset = Dataset(tmp_path / "a.bin", SEQ, packing="pack")
    whole = DataLoader(dataset, batch_rows=4, seed=7)
    for _ in range(3):
        whole.next_batch()
    state = json.loads(json.dumps(whole.state_dict()))
    assert state["packing"] == "pack"
    assert dataset.num_windows < 9 * 4  # the batches below cross into the second epoch
    expected = [whole.next_batch() for _ in range(6)]
    resumed = DataLoader(Dataset(tmp_path / "a.bin", SEQ, packing="pack"), batch_rows=4, seed=7)
    resumed.load_state_dict(state)
    parts = [DataLoader(dataset, batch_rows=4, seed=7, part=(p, 2)) for p in range(2)]
    for loader in parts:
        loader.load_state_dict(state)
    for batch in expected:
        again = resumed.next_batch()
        halves = [loader.next_batch() for loader in parts]
        assert len(batch) == 3
        for name, a, b, h0, h1 in zip(("inputs", "targets", "positions"), batch, again, *halves):
            np.testing.assert_array_equal(a, b, err_msg=name)
            np.testing.assert_array_equal(np.concatenate([h0, h1]), a, err_msg=f"parts of {name}")
    streamed = DataLoader(Dataset(tmp_path / "a.bin", SEQ), batch_rows=4, seed=7)
    with pytest.raises(ValueError, match="packing 'pack'"):
        streamed.load_state_dict(state)


def test_a_multi_turn_conversation_packs_as_one_document_and_files_without_starts_split_at_eos(tmp_path):
    # An SFT conversation ends every assistant turn with EOS; nanoq tokenize
    # records where each conversation starts, so the second turn continues
    # the first one's positions and attends to it. The same tokens in a
    # file without document starts (llm.q's, older nanoq's) split at EOS.
    from nanoq.tokenization import tokenize_files
    from test_sft import write_jsonl

    turns = [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"},
             {"role": "user", "content": "and times three"}, {"role": "assistant", "content": "twelve"}]
    corpus = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}] * 3)
    result = tokenize_files([corpus], tmp_path / "data", fmt="sft", train_tokenizer_vocab=300, progress=False)
    written = TokenFile(tmp_path / "data" / "train_000000.bin")
    conversation = len(written) // 3
    assert written.document_starts.tolist() == [0, conversation, 2 * conversation]
    assert int((written.tokens[:conversation] == result.eos_id).sum()) == 2  # an EOS after each assistant turn
    seq = conversation - 1  # one conversation fills a window
    inputs, targets, positions = Dataset(tmp_path / "data" / "train_*.bin", seq, packing="auto").read_windows([0])
    np.testing.assert_array_equal(positions[0], np.arange(seq))
    np.testing.assert_array_equal(inputs[0], written.tokens[:seq])

    (tmp_path / "old").mkdir()
    write_tokens(tmp_path / "old" / "train_000000.bin", written.tokens, written.vocab_size, mask=written.mask)
    (tmp_path / "old" / "tokenize.json").write_text(json.dumps({"eos_id": result.eos_id, "packing": "pack"}))
    old = Dataset(tmp_path / "old" / "train_*.bin", seq, packing="auto")
    assert old.files[0].document_starts is None
    first_turn = int(np.flatnonzero(written.tokens[:conversation] == result.eos_id)[0]) + 1
    _, _, positions = old.read_windows([0])
    assert positions[0].tolist()[:first_turn] == list(range(first_turn - 1)) + [0]  # turn 2 restarts


def test_pack_takes_recorded_document_starts_and_needs_no_eos_then(tmp_path):
    # Documents [0, 5), [5, 12), [12, 15): the EOS (1) inside the second does not end it.
    tokens = np.array([2, 3, 4, 5, 1, 6, 7, 1, 8, 9, 10, 1, 11, 12, 1], dtype=np.int32)
    write_tokens(tmp_path / "d.bin", tokens, VOCAB, document_starts=[0, 5, 12])
    dataset = Dataset(tmp_path / "d.bin", SEQ, packing="pack")
    assert dataset.eos_id is None  # no tokenize.json: not needed, every file records its documents
    inputs, targets, positions = dataset.read_windows([0])
    assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]
    assert inputs[0].tolist() == [2, 3, 4, 5, 6, 7, 1, 8, 9, 10, 11, 12]
    assert targets[0].tolist() == [3, 4, 5, 1, 7, 1, 8, 9, 10, 1, 12, 1]
    assert dataset.num_windows == 1


def test_eval_loader_pads_packed_batches_with_ignored_rows(tmp_path):
    write_documents(tmp_path / "e.bin", LENGTHS)
    dataset = Dataset(tmp_path / "e.bin", SEQ, packing="pack")
    batches = list(EvalLoader(dataset, batch_rows=4))
    assert len(batches) == 3  # 9 windows
    inputs, targets, positions = batches[-1]
    rows = dataset.num_windows - 8
    assert (targets[rows:] == -100).all() and (inputs[rows:] == 0).all() and (positions[rows:] == 0).all()
    for got, want in zip(batches[-1], dataset.read_windows(np.arange(8, 8 + rows))):
        np.testing.assert_array_equal(got[:rows], want)


def test_packing_auto_follows_tokenize_json_and_pack_needs_the_eos(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "p").mkdir()
    write_documents(tmp_path / "s" / "x.bin", LENGTHS, with_summary=False)
    write_documents(tmp_path / "p" / "x.bin", LENGTHS)
    assert default_packing(tmp_path / "p" / "x.bin") == "pack"
    assert default_packing(tmp_path / "s" / "x.bin") == "stream"
    assert Dataset(tmp_path / "p" / "x.bin", SEQ, packing="auto").packing == "pack"
    assert Dataset(tmp_path / "s" / "x.bin", SEQ, packing="auto").packing == "stream"
    with pytest.raises(ValueError, match="EOS id"):
        Dataset(tmp_path / "s" / "x.bin", SEQ, packing="pack")
    assert Dataset(tmp_path / "s" / "x.bin", SEQ, packing="pack", eos_id=EOS).num_windows == 9
    with pytest.raises(ValueError, match="packing must be one of"):
        Dataset(tmp_path / "s" / "x.bin", SEQ, packing="packed")
    with pytest.raises(ValueError, match="window_step"):
        Dataset(tmp_path / "p" / "x.bin", SEQ, packing="pack", window_step=SEQ + 1)


def test_sft_tokenization_records_pack_and_its_batches_train(tmp_path):
    import nanoq
    from conftest import train_options
    from nanoq.tokenization import tokenize_files
    from test_sft import sft_records, write_jsonl

    corpus = write_jsonl(tmp_path / "sft.jsonl", sft_records(12, seed=0))
    tokenize_files([corpus], tmp_path / "data", fmt="sft", train_tokenizer_vocab=300, progress=False)
    summary = json.loads((tmp_path / "data" / "tokenize.json").read_text())
    assert summary["packing"] == "pack"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # examples longer than 32 positions are cut
        dataset = Dataset(tmp_path / "data" / "train_*.bin", 32, packing="auto")
    assert dataset.packing == "pack"
    loader = DataLoader(dataset, batch_rows=2, seed=0)
    config = nanoq.ModelConfig(vocab_size=dataset.max_token + 1, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2)
    with nanoq.Trainer(config, train_options(batch_size=2, seq_len=32)) as tr:
        tr.init_weights(seed=0)
        tr.step(*loader.next_batch())
        assert tr.update(lr=1e-3).tokens > 0


def test_nanoq_train_packs_sft_files_by_default_and_stream_on_request(tmp_path):
    # data.packing "auto" (the default) follows tokenize.json: the run's
    # loader state, saved in its checkpoint, says what it served.
    from nanoq.checkpoint import read_state
    from nanoq.tokenization import tokenize_files
    from nanoq.training import TrainConfig, train
    from test_sft import sft_records, write_jsonl

    corpus = write_jsonl(tmp_path / "sft.jsonl", sft_records(24, seed=0))
    tokenize_files([corpus], tmp_path / "data", fmt="sft", train_tokenizer_vocab=300, progress=False)
    served = {}
    for packing in ("auto", "stream"):
        config = TrainConfig(train_data=str(tmp_path / "data" / "train_*.bin"), hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, seq_len=64, batch_size=2, steps=2,
                             warmup_steps=0, backend="cpu", threads=1, eval_every=0, sample_every=0,
                             checkpoint_every=2, out_dir=str(tmp_path / "runs"), run_name=packing, packing=packing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # examples longer than a window are cut
            train(config, say=lambda line: None, progress=False)
        state = read_state(str(tmp_path / "runs" / packing / "checkpoints" / "step_00000002"))
        served[packing] = state["extra_state"]["data_loader"]["packing"]
    assert served == {"auto": "pack", "stream": "stream"}
