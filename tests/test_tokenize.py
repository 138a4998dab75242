"""nanoq.tokenization: documents, EOS, SFT masks, splits, workers, bad input and Nano imports."""
import base64
import json
import os
import pickle

import numpy as np
import pytest

from nanoq.data import TokenFile
from nanoq.tokenization import (InputError, decode_line, import_nano, read_documents, tokenize_files,
                                train_bpe_tokenizer)
from nanoq.tokenization.tokenizer import write_tokenizer_config

CORPUS = ("The quick brown fox jumps over the lazy dog. " * 3 + "\n" +
          "A journey of a thousand miles begins with a single step. " * 3)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny trained byte-level BPE (vocab 300) with a tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = train_bpe_tokenizer([CORPUS], 300)
    tokenizer.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(str(directory / "tokenizer_config.json"), "<|endoftext|>")
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_text_files_are_documents_separated_by_eos(tmp_path, tokenizer_dir, tokenizer):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the lazy dog")
    b.write_text("a single step")
    result = tokenize_files([a, b], tmp_path / "out", tokenizer=tokenizer_dir)
    eos = tokenizer.token_to_id("<|endoftext|>")
    train = TokenFile(tmp_path / "out" / "train_000000.bin")
    expected = encode(tokenizer, "the lazy dog") + [eos] + encode(tokenizer, "a single step") + [eos]
    assert train.tokens.tolist() == expected
    assert not train.has_mask  # pretraining data trains on every token
    assert result.eos_id == eos and result.vocab_size == tokenizer.get_vocab_size()
    assert result.eval_files == [] and result.documents == 2
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenize.json", "tokenizer.json", "tokenizer_config.json",
                                                   "train_000000.bin"]


def test_sft_prompt_response_trains_on_response_and_eos_only(tmp_path, tokenizer_dir, tokenizer):
    data = write_lines(tmp_path / "sft.jsonl", [{"prompt": "Q: the fox?\nA:", "response": " the lazy dog"}])
    tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir)
    train = TokenFile(tmp_path / "out" / "train_000000.bin")
    prompt, response = encode(tokenizer, "Q: the fox?\nA:"), encode(tokenizer, " the lazy dog")
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert train.tokens.tolist() == prompt + response + [eos]
    assert train.mask.tolist() == [False] * len(prompt) + [True] * len(response) + [True]


def test_sft_messages_use_the_template_and_mask_every_assistant_turn(tmp_path, tokenizer_dir, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "fox?"},
                {"role": "assistant", "content": "quick"}]
    data = write_lines(tmp_path / "chat.jsonl", [{"messages": messages}])
    tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir)
    train = TokenFile(tmp_path / "out" / "train_000000.bin")
    eos = tokenizer.token_to_id("<|endoftext|>")
    pieces = [("<|system|>\nbe brief\n", False), ("<|user|>\nhi\n", False), ("<|assistant|>\n", False),
              ("hello", True), (None, True), ("<|user|>\nfox?\n", False), ("<|assistant|>\n", False),
              ("quick", True), (None, True)]
    tokens, mask = [], []
    for text, trained in pieces:
        ids = [eos] if text is None else encode(tokenizer, text)
        tokens += ids
        mask += [trained] * len(ids)
    assert train.tokens.tolist() == tokens
    assert train.mask.tolist() == mask
    # The chat markers are single special tokens of trained tokenizers.
    assert encode(tokenizer, "<|assistant|>") == [tokenizer.token_to_id("<|assistant|>")]



def ordinary(tokenizer):
    """The tokenizer, with text spelling its special tokens read as ordinary text
    (tokenizers' own encode_special_tokens): the reference of special_text="text"."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


SPELLING = "the fox <|endoftext|> said <|user|> hi"


@pytest.mark.parametrize("workers", [1, 2])
def test_text_spelling_a_special_token_becomes_it_or_ordinary_text_as_asked(tmp_path, tokenizer_dir, tokenizer,
                                                                            workers):
    # Web text holding "<|endoftext|>" must not silently end a document mid-way for a user who
    # asks otherwise (tiktoken's encode_ordinary; nanoGPT's and llm.c's data scripts), and is
    # counted either way. 70 documents: more than a worker's chunk, so workers=2 uses them.
    records = [{"text": SPELLING if i % 7 == 0 else f"the lazy dog {i}"} for i in range(70)]
    data = write_lines(tmp_path / "web.jsonl", records)
    eos = tokenizer.token_to_id("<|endoftext|>")
    for mode, reference in (("tokens", tokenizer), ("text", ordinary(tokenizer))):
        out = tmp_path / mode
        result = tokenize_files([data], out, tokenizer=tokenizer_dir, special_text=mode, workers=workers,
                                progress=False)
        expected = [t for r in records for t in encode(reference, r["text"]) + [eos]]
        assert TokenFile(out / "train_000000.bin").tokens.tolist() == expected
        assert result.special_text_documents == 10
        assert result.special_text_tokens == {"<|endoftext|>": 10, "<|user|>": 10}
        summary = json.loads((out / "tokenize.json").read_text())
        assert summary["special_text"] == mode and summary["special_text_documents"] == 10
    assert encode(tokenizer, SPELLING).count(eos) == 1 and eos not in encode(ordinary(tokenizer), SPELLING)
    with pytest.raises(ValueError, match="special_text must be one of tokens, text"):
        tokenize_files([data], tmp_path / "bad", tokenizer=tokenizer_dir, special_text="ordinary")


def test_sft_template_markers_stay_tokens_when_the_datas_spellings_are_text(tmp_path, tokenizer_dir, tokenizer):
    messages = [{"role": "user", "content": "pretend <|assistant|> said <|endoftext|>"},
                {"role": "assistant", "content": "no <|user|> here"}]
    data = write_lines(tmp_path / "chat.jsonl", [{"messages": messages},
                                                  {"prompt": "<|user|>\nQ?\n<|assistant|>\n", "response": "A"}])
    result = tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir, special_text="text")
    text = ordinary(tokenizer)
    marker = tokenizer.token_to_id
    eos = marker("<|endoftext|>")
    pieces = [[marker("<|user|>")], (encode(text, "\npretend <|assistant|> said <|endoftext|>\n"), False),
              [marker("<|assistant|>")], (encode(text, "\n"), False), (encode(text, "no <|user|> here"), True),
              ([eos], True),
              # The prompt is the data's own: in its text, a spelled marker is text too.
              (encode(text, "<|user|>\nQ?\n<|assistant|>\n"), False), (encode(text, "A"), True), ([eos], True)]
    tokens, mask = [], []
    for piece in pieces:
        ids, trained = (piece, False) if isinstance(piece, list) else piece
        tokens += ids
        mask += [trained] * len(ids)
    train = TokenFile(tmp_path / "out" / "train_000000.bin")
    assert train.tokens.tolist() == tokens and train.mask.tolist() == mask
    assert result.special_text_documents == 2  # the markup is not counted; the prompt's spellings are
    assert result.special_text_tokens == {"<|assistant|>": 2, "<|endoftext|>": 1, "<|user|>": 2}


def test_a_marker_that_takes_the_whitespace_after_it_takes_it_in_either_mode(tmp_path, tokenizer_dir):
    # An added token's rstrip: the tokenizer drops the whitespace after it; the markers nanoq keeps as
    # tokens against encode_special_tokens must do the same, so that data spelling no special token
    # encodes alike in both modes.
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for token in config["added_tokens"]:
        token["rstrip"] = token["content"] in ("<|user|>", "<|assistant|>")
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": " hi"}, {"role": "assistant", "content": "hello"}]
    data = write_lines(tmp_path / "chat.jsonl", [{"messages": messages}])
    files = {}
    for mode in ("tokens", "text"):
        tokenize_files([data], tmp_path / mode, fmt="sft", tokenizer=directory, special_text=mode)
        files[mode] = TokenFile(tmp_path / mode / "train_000000.bin")
    assert files["text"].tokens.tolist() == files["tokens"].tokens.tolist()
    assert files["text"].mask.tolist() == files["tokens"].mask.tolist()
    from tokenizers import Tokenizer

    stripping = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert encode(stripping, "<|user|>\n hi") == encode(stripping, "<|user|>hi")  # the tokenizer does strip


def texts(path, fmt="text", split="file"):
    return [text for document in read_documents(str(path), fmt, split=split) for text, _ in document.segments]


def test_lines_end_at_newlines_only_paragraphs_at_whitespace_lines_and_a_bom_is_dropped(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("a form\x0cfeed and a\u2028line separator\r\nsecond\rthird\n \nfourth\n".encode())
    assert texts(path, split="line") == ["a form\x0cfeed and a\u2028line separator", "second", "third", "fourth"]
    path.write_bytes(b"para one\r\rpara two\n \t\npara\nthree\n\n\n\x0c\npara four\n")
    assert texts(path, split="paragraph") == ["para one", "para two", "para\nthree", "para four"]
    path.write_bytes("\ufeffhello\nworld".encode())
    assert texts(path) == ["hello\nworld"]
    assert texts(path, split="line") == ["hello", "world"]
    path.write_bytes('\ufeff{"text": "hello"}\n'.encode())
    assert texts(path, fmt="jsonl") == ["hello"]


def test_jsonl_bad_lines_name_the_file_and_line(tmp_path, tokenizer_dir):
    data = write_lines(tmp_path / "bad.jsonl", [{"text": "ok"}, "{not json", {"text": "fine"}])
    with pytest.raises(InputError, match=r"bad\.jsonl:2: not valid JSON"):
        tokenize_files([data], tmp_path / "out", tokenizer=tokenizer_dir)
    data = write_lines(tmp_path / "field.jsonl", [{"text": "ok"}, "", {"body": "no text"}])
    with pytest.raises(InputError, match=r"field\.jsonl:3: has no field 'text' \(keys: body\)"):
        tokenize_files([data], tmp_path / "out", tokenizer=tokenizer_dir)
    # A field that is there but holds no text: not a --text-field problem (that was the hint).
    data = write_lines(tmp_path / "typed.jsonl", [{"text": 123}])
    with pytest.raises(InputError, match=r"typed\.jsonl:1: field 'text' holds int 123, not a string of text$"):
        tokenize_files([data], tmp_path / "out", tokenizer=tokenizer_dir)
    # (json's own message ends in "at": it was doubled)
    data = write_lines(tmp_path / "control.jsonl", ['{"text": "a\tb"}'])
    with pytest.raises(InputError, match=r"control\.jsonl:1: not valid JSON \(Invalid control character at column"):
        tokenize_files([data], tmp_path / "out", tokenizer=tokenizer_dir)
    data = write_lines(tmp_path / "sft.jsonl", [{"prompt": "p"}])
    with pytest.raises(InputError, match=r"sft\.jsonl:1: an SFT line needs"):
        tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir)
    assert not os.path.exists(tmp_path / "out")


def test_a_lone_surrogate_is_named_by_file_and_line_and_a_pair_is_text(tmp_path, tokenizer_dir):
    data = write_lines(tmp_path / "s.jsonl", ['{"text": "an emoji \\ud83d\\ude00 pair"}',
                                              '{"text": "a backslash then \\\\ud800"}',
                                              '{"text": "bad \\ud800 surrogate"}'])
    with pytest.raises(InputError, match=r"s\.jsonl:3: a string holds the lone surrogate '\\ud800'"):
        tokenize_files([data], tmp_path / "out", train_tokenizer_vocab=300)
    chat = write_lines(tmp_path / "chat.jsonl", ['{"messages": [{"role": "user", "content": "\\udfff"}]}'])
    with pytest.raises(InputError, match=r"chat\.jsonl:1: .*lone surrogate"):
        tokenize_files([chat], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir)
    assert texts(write_lines(tmp_path / "ok.jsonl", ['{"text": "\\ud83d\\ude00 \\\\ud800"}']), "jsonl") == \
        ["\U0001F600 \\ud800"]
    assert not os.path.exists(tmp_path / "out")


def test_empty_corpus_is_an_error_and_leaves_no_output(tmp_path, tokenizer_dir):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(InputError, match="the corpus is empty"):
        tokenize_files([tmp_path / "empty.txt"], tmp_path / "out", tokenizer=tokenizer_dir)
    assert sorted(os.listdir(tmp_path)) == ["empty.txt"]


def test_failure_while_writing_removes_the_partial_output(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "a.txt").write_text("the lazy dog")
    import nanoq.tokenization.pipeline as pipeline

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pipeline, "write_token_shards", fail)
    with pytest.raises(OSError, match="disk full"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tokenizer_dir)
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_existing_output_is_never_overwritten(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("the lazy dog")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.bin").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tokenizer_dir)
    assert os.listdir(tmp_path / "out") == ["keep.bin"]


def test_an_output_that_cannot_be_made_is_refused_before_any_work(tmp_path, tokenizer_dir, monkeypatch):
    from click.testing import CliRunner
    from nanoq import tokenization
    from nanoq_cli.main import cli

    (tmp_path / "a.txt").write_text("the lazy dog")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(tokenization, "read_documents", lambda *a, **k: pytest.fail("read before checking the output"))
    for output, expected in ((tmp_path / "a.txt" / "sub", f"{tmp_path / 'a.txt'} is a file, not a directory"),
                             (tmp_path / "a.txt" / "x" / "y", f"{tmp_path / 'a.txt'} is a file, not a directory"),
                             (tmp_path / "dangling", f"is a symbolic link to {tmp_path / 'nowhere'}, which does not")):
        with pytest.raises(FileExistsError, match=expected):
            tokenize_files([tmp_path / "a.txt"], output, tokenizer=tokenizer_dir)
        with pytest.raises(FileExistsError, match=expected):  # (not the InputError of reading a.txt as Nano's)
            import_nano([tmp_path / "a.txt"], output, vocab_size=10)
        # The command says it in one line (it printed a traceback, after the work for the link).
        result = CliRunner().invoke(cli, ["tokenize", str(tmp_path / "a.txt"), "-o", str(output),
                                          "--tokenizer", str(tokenizer_dir)])
        assert result.exit_code == 1 and result.output.startswith("Error: output ") and expected in result.output
        assert not isinstance(result.exception, FileExistsError), result.exception
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "dangling"]


def held_out_lines(tmp_path, name, seed, workers=1, lines=10):
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"line {i} of the quick brown fox\n" for i in range(lines)))
    result = tokenize_files([data], tmp_path / name, split="line", train_tokenizer_vocab=300,
                            eval_fraction=0.2, seed=seed, workers=workers, progress=False)
    return result, TokenFile(tmp_path / name / "eval_000000.bin"), TokenFile(tmp_path / name / "train_000000.bin")


def test_eval_split_is_by_document_and_deterministic_in_the_seed(tmp_path):
    result, eval_a, _ = held_out_lines(tmp_path, "a", seed=1)
    _, eval_b, _ = held_out_lines(tmp_path, "b", seed=1)
    _, eval_c, _ = held_out_lines(tmp_path, "c", seed=2)
    assert result.documents == 10 and result.eval_documents == 2
    assert np.array_equal(eval_a.tokens, eval_b.tokens)
    assert not np.array_equal(eval_a.tokens, eval_c.tokens)
    assert int((eval_a.tokens == result.eos_id).sum()) == 2  # two whole documents
    assert result.train_tokens + result.eval_tokens == sum(len(TokenFile(tmp_path / "a" / f))
                                                          for f in result.train_files + result.eval_files)


def test_worker_processes_write_the_same_tokens(tmp_path):
    _, eval_one, train_one = held_out_lines(tmp_path, "one", seed=0, workers=1, lines=200)
    _, eval_two, train_two = held_out_lines(tmp_path, "two", seed=0, workers=2, lines=200)
    assert np.array_equal(train_one.tokens, train_two.tokens)
    assert np.array_equal(eval_one.tokens, eval_two.tokens)


def test_shards_hold_whole_documents(tmp_path, tokenizer_dir, tokenizer):
    records = [{"prompt": f"Q: fox {i}?\nA:", "response": f" the lazy dog {i}"} for i in range(20)]
    data = write_lines(tmp_path / "sft.jsonl", records)
    result = tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir, shard_tokens=50)
    eos = tokenizer.token_to_id("<|endoftext|>")
    shards = [TokenFile(tmp_path / "out" / name) for name in result.train_files]
    assert len(shards) > 1 and all(len(f) <= 50 for f in shards)
    texts = []
    for shard in shards:
        assert shard.tokens[-1] == eos and tokenizer.decode(shard.tokens[:3].tolist()).startswith("Q:")
        ends = shard.document_starts.tolist()[1:] + [len(shard)]
        texts += [tokenizer.decode(shard.tokens[a:b].tolist()) for a, b in zip(shard.document_starts, ends)]
    assert texts == [r["prompt"] + r["response"] for r in records]


@pytest.mark.parametrize("workers", [1, 2])
def test_truncation_and_padding_saved_in_the_tokenizer_are_not_applied(tmp_path, tokenizer, workers):
    # Many saved tokenizer.json files carry a max_length; nanoq encodes whole documents.
    saved = train_bpe_tokenizer([CORPUS], 300)
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=32, pad_id=0, pad_token="<|endoftext|>")
    (tmp_path / "tok").mkdir()
    saved.save(str(tmp_path / "tok" / "tokenizer.json"))
    lines = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(70)]  # > 64: workers encode
    (tmp_path / "lines.txt").write_text("\n".join(lines))
    result = tokenize_files([tmp_path / "lines.txt"], tmp_path / "out", split="line", tokenizer=tmp_path / "tok",
                            workers=workers, progress=False)
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [t for line in lines for t in encode(tokenizer, line) + [eos]]
    assert TokenFile(tmp_path / "out" / "train_000000.bin").tokens.tolist() == expected
    assert result.train_tokens == len(expected)


def test_a_tokenizer_with_unused_ids_has_its_highest_id_plus_one_as_vocab(tmp_path):
    # Vocabularies may leave ids unused (reserved ranges): move the first token of the text past a gap.
    from tokenizers import Tokenizer

    trained = train_bpe_tokenizer([CORPUS], 300)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    highest = max(vocab.values())
    vocab[trained.id_to_token(encode(trained, "the lazy dog")[0])] = highest + 100
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    gapped = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("the lazy dog")
    result = tokenize_files([tmp_path / "c.txt"], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert gapped.get_vocab_size() == highest + 1 and result.vocab_size == highest + 101  # entries, ids
    written = TokenFile(tmp_path / "out" / "train_000000.bin")
    assert written.vocab_size == highest + 101 and highest + 100 in written.tokens.tolist()
    assert written.tokens.tolist() == encode(gapped, "the lazy dog") + [gapped.token_to_id("<|endoftext|>")]


def test_eval_fraction_that_leaves_no_training_document_is_an_error(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("one document")
    with pytest.raises(ValueError, match="leaves none for training"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tokenizer_dir, eval_fraction=0.1)


# -- Nano's base64-pickled lines ------------------------------------------------------


def nano_line(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def test_nano_lines_import_pretraining_and_sft_with_masks(tmp_path):
    lines = [
        nano_line([5, 6, 7]),                                              # pretraining
        nano_line(([1, 2, 3], [0, 0, 1])),                                 # (ids, mask)
        nano_line(([4, 5, 6], [-100, 5, 6])),                              # (ids, labels)
        nano_line({"input_ids": [7, 8], "labels": [-100, 8]}),
        nano_line({"input_ids": (9, 1), "mask": [True, False]}),
    ]
    data = tmp_path / "nano.txt"
    data.write_text("\n".join(lines) + "\n\n")
    result = import_nano([data], tmp_path / "out", vocab_size=16, eos_id=0)
    train = TokenFile(tmp_path / "out" / "train_000000.bin")
    assert train.vocab_size == 16 and result.documents == 5
    assert train.tokens.tolist() == [5, 6, 7, 0, 1, 2, 3, 0, 4, 5, 6, 0, 7, 8, 0, 9, 1, 0]
    # EOS after a pretraining line is trained on; after an SFT line it is not.
    assert train.mask.astype(int).tolist() == [1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0]


def test_nano_import_refuses_a_pickle_that_would_run_code(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = tmp_path / "nano.txt"
    data.write_text(nano_line([1, 2]) + "\n" + nano_line(Exploit()) + "\n")
    with pytest.raises(InputError, match=r"nano\.txt:2: refused to unpickle: the pickle refers to "
                                         r"(posix|os|nt)\.system"):
        import_nano([data], tmp_path / "out", vocab_size=16)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_nano_bad_lines_are_named(tmp_path):
    with pytest.raises(InputError, match="f:3: not base64"):
        decode_line("not base64!!", "f:3")
    with pytest.raises(InputError, match="f:1: a pretraining line must be a list of integers"):
        decode_line(nano_line([1.5, 2]), "f:1")
    with pytest.raises(InputError, match="mask must hold one 0/1 per token"):
        decode_line(nano_line(([1, 2], [1])), "f:1")
    data = tmp_path / "nano.txt"
    data.write_text(nano_line([1, 99]) + "\n")
    with pytest.raises(InputError, match=r"nano\.txt:1: token id 99 is outside"):
        import_nano([data], tmp_path / "out", vocab_size=16)


def test_an_eos_token_other_than_a_trained_tokenizers_is_refused_and_says_whose_it_is(tmp_path):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    data = write_lines(tmp_path / "tiny.jsonl", [{"content": f"line {i} of the quick brown fox"} for i in range(20)])
    command = ["tokenize", data, "-o", str(tmp_path / "x"), "--train-tokenizer", "--vocab-size", "300",
               "--text-field", "content"]
    # A trained tokenizer's EOS is <|endoftext|>: any other --eos-token is refused before training, by name.
    result = CliRunner().invoke(cli, command + ["--eos-token", "</s>"])
    assert result.exit_code == 1
    assert result.output == ("Error: EOS token '</s>' (--eos-token) does not go with a trained tokenizer "
                             "(--train-tokenizer), whose EOS is always <|endoftext|>: leave it out, or give a "
                             "tokenizer (--tokenizer) whose vocabulary has '</s>'\n")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"EOS token '</s>' \(--eos-token\) does not go with a trained tokenizer"):
        tokenize_files([data], tmp_path / "y", text_field="content", train_tokenizer_vocab=300, eos_token="</s>")
    # Its own EOS, given, is that EOS.
    result = CliRunner().invoke(cli, command + ["--eos-token", "<|endoftext|>"])
    assert result.exit_code == 0, result.output
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tmp_path / "x" / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert f"EOS id {eos} " in result.output
    # The option's help says which tokenizer it is for.
    help_text = " ".join(CliRunner().invoke(cli, ["tokenize", "--help"]).output.split())
    assert ("--eos-token TEXT --tokenizer's end-of-sequence token, written between documents (default: detected). "
            "A --train-tokenizer's is always <|endoftext|>.") in help_text


def test_an_eos_token_missing_from_a_tokenizer_names_the_tokenizer(tmp_path, tokenizer_dir, tokenizer):
    from nanoq.tokenization.tokenizer import find_eos_id

    with pytest.raises(ValueError) as caught:
        find_eos_id(tokenizer, "</s>")
    assert str(caught.value) == "EOS token '</s>' is not in the vocabulary of the tokenizer"
    data = tmp_path / "a.txt"
    data.write_text("the lazy dog")
    with pytest.raises(ValueError) as caught:
        tokenize_files([data], tmp_path / "out", tokenizer=tokenizer_dir, eos_token="</s>")
    assert str(caught.value) == f"EOS token '</s>' is not in the vocabulary of tokenizer {str(tokenizer_dir)!r}"


def test_options_and_inputs_that_would_be_ignored_or_doubled_are_refused_and_odd_ones_named(tmp_path, tokenizer_dir):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    text = tmp_path / "a.txt"
    text.write_text("the lazy dog\n\nthe quick fox")
    lines = write_lines(tmp_path / "b.jsonl", [{"text": "the lazy dog"}])

    def run(*args):
        return CliRunner().invoke(cli, ["tokenize", *map(str, args), "--tokenizer", str(tokenizer_dir)])

    # Options for another format than the inputs' were taken without a word.
    result = run(text, "-o", tmp_path / "o1", "--text-field", "body")
    assert result.exit_code == 2 and "--text-field is for JSONL inputs" in result.output and "read as text" in \
        result.output
    result = run(lines, "-o", tmp_path / "o2", "--split", "line")
    assert result.exit_code == 2 and "--split is for text inputs" in result.output
    # The same file twice (also by another name) tokenized its documents twice.
    (tmp_path / "link.txt").symlink_to(text)
    result = run(text, tmp_path / "link.txt", "-o", tmp_path / "o3")
    assert result.exit_code == 2 and f"input {tmp_path / 'link.txt'} is given twice (as {text})" in result.output
    assert run(text, lines, "-o", tmp_path / "o4", "--split", "paragraph").exit_code == 0  # (one of them is text)
    # More workers than cores: said (it ran 150 times slower than one worker, silently).
    cores = len(os.sched_getaffinity(0))
    result = run(text, "-o", tmp_path / "o5", "--workers", cores + 1)
    assert result.exit_code == 0 and f"note: --workers {cores + 1} is more than the {cores} cores" in result.output
    # An ordinary token as the EOS: every place the text holds it ends a document too.
    result = run(text, "-o", tmp_path / "o6", "--eos-token", "a")
    assert result.exit_code == 0 and "warning: the EOS token 'a'" in result.output and \
        "is an ordinary token of the tokenizer" in result.output
    assert "warning" not in run(text, "-o", tmp_path / "o7").output
    # A .json file is JSON Lines here, and a JSON file that is no tokenizer is named as such.
    (tmp_path / "array.json").write_text('[{"text": "a"}]')
    with pytest.raises(InputError, match=r"array\.json:1: expected a JSON object, got list; a \.json file is read "
                                         r"as JSON Lines"):
        tokenize_files([tmp_path / "array.json"], tmp_path / "o8", tokenizer=tokenizer_dir)
    (tmp_path / "other.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match=r"other\.json is JSON but not a tokenizer\.json \(it has no \"model\"\)"):
        tokenize_files([text], tmp_path / "o9", tokenizer=tmp_path / "other.json")


def test_sft_lines_that_train_nothing_are_counted_and_ambiguous_ones_refused(tmp_path, tokenizer_dir):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    data = write_lines(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "anyone there?"}]},  # no assistant turn: nothing trains
        {"prompt": "the lazy", "response": " dog"}])
    result = tokenize_files([data], tmp_path / "out", fmt="sft", tokenizer=tokenizer_dir)
    assert result.untrained_documents == 1
    output = CliRunner().invoke(cli, ["tokenize", data, "-o", str(tmp_path / "cli"), "--format", "sft",
                                      "--tokenizer", str(tokenizer_dir)]).output
    assert "note: 1 document(s) hold nothing to train on (SFT conversations without an assistant turn)" in output
    assert tokenize_files([write_lines(tmp_path / "text.jsonl", [{"text": "the dog"}])], tmp_path / "text",
                          tokenizer=tokenizer_dir).untrained_documents == 0
    # Both forms in one line: 'messages' was taken and the prompt/response dropped without a word.
    both = write_lines(tmp_path / "both.jsonl", [{"prompt": "p", "response": "r",
                                                   "messages": [{"role": "assistant", "content": "m"}]}])
    with pytest.raises(InputError, match=r"both\.jsonl:1: an SFT line has 'messages' and 'prompt'/'response'"):
        tokenize_files([both], tmp_path / "both", fmt="sft", tokenizer=tokenizer_dir)


def test_a_tokenizer_file_loaded_again_gives_the_same_tokenizer_until_it_changes(tmp_path):
    # Each fresh Tokenizer that encodes keeps a few MB the tokenizers library never frees: a notebook
    # training on the demo again and again grew ~6 MB per run. An unchanged file is loaded once.
    from nanoq.tokenization.tokenizer import load_tokenizer

    train_bpe_tokenizer([CORPUS], 300).save(str(tmp_path / "tokenizer.json"))
    first = load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path / "tokenizer.json") is first
    assert first.get_vocab_size() == 300
    train_bpe_tokenizer([CORPUS], 280).save(str(tmp_path / "tokenizer.json"))  # rewritten: read anew
    again = load_tokenizer(tmp_path)
    assert again is not first and again.get_vocab_size() == 280
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="is JSON but not a tokenizer.json"):
        load_tokenizer(tmp_path)
