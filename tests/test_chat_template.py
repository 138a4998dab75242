"""The chat template that `nanoq tokenize --format sft` writes: transformers'
apply_chat_template on the saved (and the exported) tokenizer gives exactly
the token ids nanoq trained on, and with return_assistant_tokens_mask the
mask nanoq trained with.

(nanoq encodes the assistant's marker and its reply apart, as a prompt made
with add_generation_prompt=True is encoded; transformers encodes a whole
conversation at once, so a reply that starts with whitespace may be joined
to the marker's newline by a tokenizer's merges. The replies here do not.)"""
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from nanoq.data import TokenFile
from nanoq.demo import DEMO_DIR
from nanoq.training import TrainConfig, train
from nanoq_cli.main import cli

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, fox?"},
     {"role": "assistant", "content": "Hi. The quick fox."}, {"role": "user", "content": "More!"},
     {"role": "assistant", "content": "No.\nDone"}],
    [{"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": " jumps over"},
     {"role": "user", "content": "and then?"}],  # ends on the user: an untrained EOS closes it
    [{"role": "user", "content": "a brown bird sings in the morning wind"},
     {"role": "assistant", "content": "Over the river, by the stone."}],
    [{"role": "assistant", "content": "Unprompted."}],
]


def tokenize(tmp_path, *extra):
    corpus = tmp_path / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS * 3))
    output = tmp_path / "sft"
    result = CliRunner().invoke(cli, ["tokenize", str(corpus), "-o", str(output), "--format", "sft", *extra],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return output


def trained_on(folder):
    file = TokenFile(folder / "train_000000.bin")
    return np.asarray(file.tokens).tolist(), np.asarray(file.mask).astype(int).tolist()


def templated(tokenizer_dir):
    """ids and assistant masks of every chat (three times, as in the corpus) by transformers."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids, mask = [], []
    for chat in CHATS * 3:
        out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids += list(out["input_ids"])
        mask += list(out["assistant_masks"])
    return ids, mask


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    return tokenize(tmp_path_factory.mktemp("chat"), "--train-tokenizer", "--vocab-size", "300")


def test_apply_chat_template_gives_the_tokens_and_mask_nanoq_trained_on(sft_dir):
    tokens, mask = trained_on(sft_dir)
    assert templated(sft_dir) == (tokens, mask)
    assert 0 < sum(mask) < len(mask)


def test_the_generation_prompt_is_the_training_text_up_to_the_assistants_reply(sft_dir):
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    chat = CHATS[2]
    prompt = tokenizer.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True, return_dict=True)
    whole = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    prompt_ids = list(prompt["input_ids"])
    assert list(whole["input_ids"])[:len(prompt_ids)] == prompt_ids
    assert list(whole["assistant_masks"]).index(1) == len(prompt_ids)  # the reply is where training starts
    assert tokenizer.decode(prompt_ids[-2:]) == "<|assistant|>\n"


def test_the_exported_model_carries_the_template(sft_dir, tmp_path):
    config = TrainConfig(train_data=str(sft_dir / "train_*.bin"), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, seq_len=16, batch_size=2, steps=1,
                         warmup_steps=0, eval_every=0, checkpoint_every=0, backend="cpu", threads=1,
                         out_dir=str(tmp_path), run_name="chat")
    result = train(config, say=lambda line: None, progress=False)
    saved = json.loads((sft_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads(open(f"{result.model_dir}/tokenizer_config.json").read())["chat_template"] == saved
    assert templated(result.model_dir) == trained_on(sft_dir)


def test_a_given_tokenizers_template_is_replaced_by_nanoqs(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    shutil.copyfile(f"{DEMO_DIR}/tokenizer.json", source / "tokenizer.json")
    config = json.loads(open(f"{DEMO_DIR}/tokenizer_config.json").read())
    (source / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template="{{ 'other' }}")))
    output = tokenize(tmp_path, "--tokenizer", str(source))
    saved = json.loads((output / "tokenizer_config.json").read_text())
    assert saved["chat_template"] != "{{ 'other' }}" and "<|assistant|>" in saved["chat_template"]
    assert templated(output) == trained_on(output)


def test_a_tokenizer_that_adds_a_bos_starts_every_document_with_it_as_transformers_does(tmp_path):
    # A Llama tokenizer's post-processor puts <s> before a text: transformers' tokenizer(text), its chat
    # templates and nanoq generate's prompts start with it; nanoq tokenize's documents lacked it.
    from tokenizers import Tokenizer, processors

    source = tmp_path / "model"
    source.mkdir()
    tokenizer = Tokenizer.from_file(f"{DEMO_DIR}/tokenizer.json")
    tokenizer.add_special_tokens(["<s>"])
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save(str(source / "tokenizer.json"))
    shutil.copyfile(f"{DEMO_DIR}/tokenizer_config.json", source / "tokenizer_config.json")
    hf = AutoTokenizer.from_pretrained(source)
    texts = ["the lazy dog sleeps", "a brown bird sings"]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    result = CliRunner().invoke(cli, ["tokenize", str(tmp_path / "a.txt"), "-o", str(tmp_path / "text"),
                                      "--split", "paragraph", "--tokenizer", str(source)], catch_exceptions=False)
    assert result.exit_code == 0 and f"each document opening with BOS id(s) [{bos}]" in result.output
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    tokens, mask = trained_on(tmp_path / "text")
    expected = [i for text in texts for i in hf(text)["input_ids"] + [eos]]
    assert tokens == expected and expected[0] == bos
    assert [m for t, m in zip(tokens, mask) if t == bos] == [0, 0]  # the BOS is no target
    assert json.loads((tmp_path / "text" / "tokenize.json").read_text())["bos_ids"] == [bos]
    # SFT: the template writes the BOS first, so apply_chat_template still gives what nanoq trained on.
    output = tokenize(tmp_path, "--tokenizer", str(source))
    tokens, mask = trained_on(output)
    assert tokens[0] == bos and templated(output) == (tokens, mask)
