"""Hugging Face export (nanoq.hf_export, ``nanoq export``): what transformers
loads from an exported directory computes what nanoq computed.

Every variant is imported into a Trainer and trained two steps first, so the
exported weights are nanoq's, not the checkpoint's it started from.
"""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner

import nanoq
from conftest import NANOQ_CONFIG, VARIANTS, assert_same_tensors, open_trainer, random_batch, run_steps, token_terms
from nanoq.hf_export import export_checkpoint, hf_config_dict, write_model
from nanoq.hf_io import iter_weights

ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "llama_tied": "LlamaForCausalLM",
    "llama3_rope": "LlamaForCausalLM",
    "llama_attn_bias": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class Trained:
    """A variant after two training steps: its config, weights, one
    validation batch with nanoq's statistics on it, and its export."""

    def __init__(self, checkpoint, directory):
        with open_trainer(checkpoint) as trainer:
            rng = np.random.default_rng(5)
            for _ in range(2):
                run_steps(trainer, [random_batch(rng, rows=2)], lr=1e-2)
            self.config = trainer.config
            self.weights = trainer.get_weights()
            self.batch = random_batch(rng, rows=2, mask_frac=0.25)
            self.stats = trainer.validate(*self.batch)
            self.directory = trainer.export_model(directory)


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = Trained(checkpoints.path(variant), tmp_path_factory.mktemp("export") / variant)
        return cache[variant]

    return get


def load_hf(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    return model.float().eval(), info


def hf_stats(model, inputs, targets):
    """(loss, lse_max, lse_mean) over the counted tokens, nanoq's definitions."""
    with torch.no_grad():
        ce, lse, mask = token_terms(model, inputs, targets)
    return float(ce[mask].double().mean()), float(lse[mask].max()), float(lse[mask].double().mean())


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_loads_export_and_computes_nanoq_loss(checkpoints, trained, variant):
    run = trained(variant)
    original = dict(iter_weights(checkpoints.path(variant)))
    assert not np.array_equal(run.weights["model.embed_tokens.weight"], original["model.embed_tokens.weight"])

    model, info = load_hf(run.directory)
    assert type(model).__name__ == ARCHITECTURE[variant]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loss, lse_max, lse_mean = hf_stats(model, *run.batch)
    assert loss == pytest.approx(run.stats.loss, rel=1e-5)
    assert lse_max == pytest.approx(run.stats.lse_max, rel=1e-5)
    assert lse_mean == pytest.approx(run.stats.lse_mean, rel=1e-5)
    if variant == "llama3_rope":
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert model.config.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_import_export_import_is_lossless(trained, variant):
    run = trained(variant)
    config = nanoq.ModelConfig.from_pretrained(run.directory)
    assert config == run.config
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", seq_len=16)) as trainer:
        trainer.import_weights(run.directory)
        assert_same_tensors(trainer.get_weights(), run.weights, "reimported weight")


def test_tied_export_has_no_lm_head(trained):
    names = [name for name, _ in iter_weights(trained("llama_tied").directory)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names



def test_a_tied_model_refuses_a_file_whose_lm_head_is_not_its_embedding(trained, tmp_path):
    # An untied export imported into a tied config: its lm_head was dropped without a word (logits off by
    # up to 0.9). A file holding an lm_head equal to the embedding (some tied exports carry both) loads.
    import dataclasses

    from safetensors.numpy import save_file

    untied = trained("llama")
    tied_config = dataclasses.replace(untied.config, tie_word_embeddings=True)
    with nanoq.Trainer(tied_config, nanoq.TrainOptions(backend="cpu", seq_len=16)) as trainer:
        before = trainer.get_weights()
        with pytest.raises(ValueError, match="its lm_head.weight differs from its model.embed_tokens.weight, but "
                                             "this model config ties them"):
            trainer.import_weights(untied.directory)
        assert_same_tensors(trainer.get_weights(), before, "weight after a refused import")  # nothing loaded
        both = {name: array for name, array in untied.weights.items()}
        both["lm_head.weight"] = both["model.embed_tokens.weight"].copy()
        (tmp_path / "both").mkdir()
        save_file(both, str(tmp_path / "both" / "model.safetensors"))
        trainer.import_weights(tmp_path / "both")
        got = trainer.get_weights()
        assert np.array_equal(got["model.embed_tokens.weight"], both["model.embed_tokens.weight"])


def test_config_json_uses_4x_rope_keys_and_declared_context(trained):
    llama3 = json.load(open(os.path.join(trained("llama3_rope").directory, "config.json")))
    assert llama3["rope_theta"] == 10000.0
    assert llama3["rope_scaling"] == dict(NANOQ_CONFIG["llama3_rope"]["rope_scaling"])
    assert llama3["max_position_embeddings"] == 2048  # what the imported config declared
    qwen2 = json.load(open(os.path.join(trained("qwen2").directory, "config.json")))
    assert qwen2["use_sliding_window"] is False and qwen2["max_position_embeddings"] == 32768
    assert qwen2["torch_dtype"] == "float32"


@pytest.mark.parametrize("variant", ["qwen2", "llama_tied"])
def test_sharded_export_loads_like_a_single_file(trained, tmp_path, variant):
    run = trained(variant)
    sharded = write_model(tmp_path / "sharded", run.weights, run.config, max_position_embeddings=16,
                          max_shard_bytes=20_000)
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(os.listdir(sharded)) == sorted(["config.json", "model.safetensors.index.json", *files])
    expected = {name: array for name, array in run.weights.items()
                if not (name == "lm_head.weight" and run.config.tie_word_embeddings)}
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(array.nbytes for array in expected.values())

    single, _ = load_hf(run.directory)
    model, info = load_hf(sharded)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    inputs = torch.from_numpy(run.batch[0]).long()
    with torch.no_grad():
        assert torch.equal(model(input_ids=inputs).logits, single(input_ids=inputs).logits)
    with nanoq.Trainer(run.config, nanoq.TrainOptions(backend="cpu", seq_len=16)) as trainer:
        trainer.import_weights(sharded)
        assert_same_tensors(trainer.get_weights(), run.weights, "weight from shards")


def test_export_into_existing_directory_is_refused(trained, tmp_path):
    run = trained("llama")
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        write_model(target, run.weights, run.config, max_position_embeddings=16)
    assert os.listdir(target) == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["model"]



def test_overwrite_replaces_a_model_directory_and_refuses_anything_else(trained, tmp_path):
    run = trained("llama")
    first = {name: array + 1 for name, array in run.weights.items()}
    target = tmp_path / "model"
    write_model(target, first, run.config, max_position_embeddings=16)
    with pytest.raises(FileExistsError, match="already exists"):  # the default still refuses
        write_model(target, run.weights, run.config, max_position_embeddings=16)
    write_model(target, run.weights, run.config, max_position_embeddings=16, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["model"]
    from safetensors.numpy import load_file

    again = load_file(str(target / "model.safetensors"))
    assert again and all(np.array_equal(again[name], run.weights[name]) for name in again)
    # A folder that is not a model (a home directory passed by mistake, say) is never replaced.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no config.json: overwrite replaces only a model directory"):
        write_model(other, run.weights, run.config, max_position_embeddings=16, overwrite=True)
    assert os.listdir(other) == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    write_model(tmp_path / "empty", run.weights, run.config, max_position_embeddings=16, overwrite=True)
    assert "config.json" in os.listdir(tmp_path / "empty")
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        write_model(tmp_path / "x", run.weights, run.config, max_position_embeddings=16, overwrite="yes")


def test_failed_export_leaves_nothing_behind(trained, tmp_path, monkeypatch):
    import safetensors
    import safetensors.numpy

    def fail(*args, **kwargs):
        raise OSError("disk full")

    run = trained("llama")  # (made before save_file fails)
    monkeypatch.setattr(safetensors.numpy, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_model(tmp_path / "model", run.weights, run.config, max_position_embeddings=16)
    assert os.listdir(tmp_path) == []

    # A full disk as safetensors reports it (its own SafetensorError, not an OSError; what it raised on a
    # full tmpfs): an OSError with its errno, as every other write nanoq makes.
    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(OSError, match="No space left on device") as raised:
        write_model(tmp_path / "model", run.weights, run.config, max_position_embeddings=16)
    assert raised.value.errno == 28 and raised.value.filename.endswith("model.safetensors")
    assert os.listdir(tmp_path) == []
    with nanoq.Trainer(run.config, nanoq.TrainOptions(backend="cpu", seq_len=16)) as trainer:
        with pytest.raises(OSError, match="No space left on device"):
            trainer.save_checkpoint(tmp_path / "checkpoints", 1)
    monkeypatch.setattr(safetensors.numpy, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        safetensors.SafetensorError("some other failure")))
    with pytest.raises(safetensors.SafetensorError, match="some other failure"):  # not a write: as it was
        write_model(tmp_path / "model", run.weights, run.config, max_position_embeddings=16)


@pytest.mark.parametrize("flags, architecture", [
    (dict(), "LlamaForCausalLM"),
    (dict(qkv_bias=True, o_bias=True), "LlamaForCausalLM"),
    (dict(qkv_bias=True), "Qwen2ForCausalLM"),
    (dict(qk_norm=True), "Qwen3ForCausalLM"),
    (dict(qk_norm=True, qkv_bias=True, o_bias=True), "Qwen3ForCausalLM"),
])
def test_config_flags_choose_the_architecture(flags, architecture):
    config = nanoq.ModelConfig(**dict(NANOQ_CONFIG["llama"], **flags))
    written = hf_config_dict(config, 64)
    assert written["architectures"] == [architecture]
    read_back = nanoq.ModelConfig.from_hf_dict(written)
    assert (read_back.qkv_bias, read_back.o_bias, read_back.qk_norm) == (config.qkv_bias, config.o_bias,
                                                                         config.qk_norm)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


@pytest.mark.parametrize("rope", [
    dict(rope_parameters=dict(LLAMA3, rope_theta=500000.0)),                      # transformers 5
    dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3)),                          # transformers 4
    dict(rope_theta=500000.0, rope_parameters=dict(LLAMA3)),                       # theta beside the parameters
    dict(rope_parameters=dict(LLAMA3)),                                            # no theta anywhere: 10000
    dict(rope_parameters=dict(rope_type="default", rope_theta=1e6), rope_scaling=dict(LLAMA3)),  # scaling wins
    dict(rope_scaling=dict(LLAMA3, type="llama3")),                                # 4.x's "type"
    dict(rope_parameters={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}),
    dict(rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    dict(rope_theta=1e6),
    dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6))),  # per layer type
])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rope_settings_are_read_as_transformers_reads_them(rope, family):
    # The same config.json, read by transformers and by nanoq: the same theta and scaling.
    config = nanoq.ModelConfig(**dict(NANOQ_CONFIG["llama"], qkv_bias=family == "qwen2"))
    raw = {key: value for key, value in hf_config_dict(config, 128).items()
           if key not in ("rope_parameters", "rope_theta", "rope_scaling")}
    raw.update(rope)
    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    theirs = config_class.from_dict(json.loads(json.dumps(raw))).rope_parameters
    if "full_attention" in theirs and family == "qwen2":  # per layer type (Llama has none)
        theirs = theirs["full_attention"]
    ours = nanoq.ModelConfig.from_hf_dict(raw)
    assert ours.rope_theta == theirs["rope_theta"]
    if theirs["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling == {key: theirs[key] for key in ["rope_type", *LLAMA3]}


@pytest.mark.parametrize("rope", [
    dict(rope_parameters=dict(rope_type="linear", factor=4.0)),
    dict(rope_theta=500000.0, rope_parameters=dict(rope_type="yarn", factor=4.0)),
    dict(rope_parameters=dict(rope_type="default", rope_theta=1e6), rope_scaling=dict(type="linear", factor=2.0)),
])
def test_rope_scalings_nanoq_does_not_compute_are_refused(rope):
    raw = dict(hf_config_dict(nanoq.ModelConfig(**NANOQ_CONFIG["llama"]), 128), **rope)
    with pytest.raises(ValueError, match="is not supported"):
        nanoq.ModelConfig.from_hf_dict(raw, source="model/config.json")


@pytest.mark.parametrize("flags", [dict(o_bias=True), dict(qk_norm=True, qkv_bias=True)])
def test_config_without_hf_architecture_is_refused(flags, tmp_path):
    config = nanoq.ModelConfig(**dict(NANOQ_CONFIG["llama"], **flags))
    with pytest.raises(ValueError, match="bias"):
        hf_config_dict(config, 64)
    with pytest.raises(ValueError, match="bias"):
        write_model(tmp_path / "model", {}, config, max_position_embeddings=64)
    assert os.listdir(tmp_path) == []


def _word_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    json.dump({"eos_token": "</s>"}, open(os.path.join(directory, "tokenizer_config.json"), "w"))
    json.dump({"eos_token": "</s>"}, open(os.path.join(directory, "special_tokens_map.json"), "w"))
    return str(directory)


def test_tokenizer_files_are_copied_and_eos_detected(trained, tmp_path):
    run = trained("llama")
    tokenizer_dir = _word_tokenizer(tmp_path / "tokenizer")
    # As transformers 5 saves a base model: its chat template in a file of its own, generation defaults.
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    open(os.path.join(tokenizer_dir, "chat_template.jinja"), "w").write(template)
    json.dump({"eos_token_id": [2, 3], "temperature": 0.7, "do_sample": True},
              open(os.path.join(tokenizer_dir, "generation_config.json"), "w"))
    out = write_model(tmp_path / "model", run.weights, run.config, max_position_embeddings=16,
                      tokenizer_dir=tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(tokenizer_dir, name), "rb").read()
    assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == 2
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == template
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.temperature, generation.do_sample) == ([2, 3], 0.7, True)
    explicit = write_model(tmp_path / "explicit", run.weights, run.config, max_position_embeddings=16,
                           tokenizer_dir=tokenizer_dir, eos_token_id=1)
    assert json.load(open(os.path.join(explicit, "config.json")))["eos_token_id"] == 1
    assert transformers.GenerationConfig.from_pretrained(explicit).eos_token_id == 1  # generate() stops there too


def test_an_imported_model_exports_with_its_tokenizer_and_special_ids(checkpoints, tmp_path):
    # Before, export_model wrote eos_token_id and bos_token_id null and no tokenizer for an imported model:
    # transformers' generate() then never stopped.
    import shutil

    def ids(directory):
        written = json.load(open(os.path.join(directory, "config.json")))
        return written["eos_token_id"], written["bos_token_id"]

    base = tmp_path / "models" / "base"
    shutil.copytree(checkpoints.path("llama"), base)
    hf = json.load(open(base / "config.json"))
    json.dump(dict(hf, eos_token_id=[5, 6], bos_token_id=4), open(base / "config.json", "w"))
    _word_tokenizer(base / "tokenizer")
    for name in os.listdir(base / "tokenizer"):
        shutil.move(base / "tokenizer" / name, base / name)
    json.dump(dict(hf, eos_token_id=99, bos_token_id=98), open(tmp_path / "models" / "config.json", "w"))
    with open_trainer(str(base)) as trainer:
        out = trainer.export_model(tmp_path / "out")
        assert ids(out) == ([5, 6], 4)
        assert open(os.path.join(out, "tokenizer.json"), "rb").read() == open(base / "tokenizer.json", "rb").read()
        other = trainer.export_model(tmp_path / "other", eos_token_id=7)
        assert ids(other) == (7, 4)  # what the caller says
        # A tokenizer given (as `nanoq train --init_from` gives the data's): its files, the base's ids, and
        # the base's generation_config.json with an instruct model's end-of-turn id (it was left behind,
        # so generate() ran past the end of a turn).
        json.dump({"eos_token_id": [5, 6, 9], "temperature": 0.6}, open(base / "generation_config.json", "w"))
        named = trainer.export_model(tmp_path / "named", tokenizer_dir=_word_tokenizer(tmp_path / "tokenizer"))
        assert ids(named) == ([5, 6], 4)
        generation = transformers.GenerationConfig.from_pretrained(named)
        assert (generation.eos_token_id, generation.temperature) == ([5, 6, 9], 0.6)
        # nanoq export of a checkpoint of these weights says the same (it recorded the base).
        step = trainer.save_checkpoint(tmp_path / "ckpt", 1)
        assert ids(export_checkpoint(step, tmp_path / "from-checkpoint", max_position_embeddings=64)) == ([5, 6], 4)
        assert os.path.isfile(tmp_path / "from-checkpoint" / "tokenizer.json")
        assert transformers.GenerationConfig.from_pretrained(tmp_path / "from-checkpoint").eos_token_id == [5, 6, 9]
        checkpoint_with_data_tokenizer = trainer.save_checkpoint(tmp_path / "ckpt2", 1,
                                                                 tokenizer_dir=str(tmp_path / "tokenizer"))
        export_checkpoint(checkpoint_with_data_tokenizer, tmp_path / "data-tokenizer", max_position_embeddings=64)
        assert transformers.GenerationConfig.from_pretrained(tmp_path / "data-tokenizer").eos_token_id == [5, 6, 9]
        os.remove(base / "generation_config.json")
        shutil.move(base, tmp_path / "moved")  # a base gone: nothing of it (nor of the folder it was in)
        assert ids(trainer.export_model(tmp_path / "gone")) == (None, None)
        shutil.move(tmp_path / "moved", base)
        trainer.init_weights(1)  # weights of its own: nothing of the import is carried over
        fresh = trainer.export_model(tmp_path / "fresh")
        assert ids(fresh) == (None, None) and not os.path.exists(os.path.join(fresh, "tokenizer.json"))


def test_export_model_refuses_non_finite_weights_unless_allowed(checkpoints, tmp_path):
    # As export_checkpoint and `nanoq export` do; before, export_model wrote NaN weights without a word.
    with open_trainer(checkpoints.path("llama")) as trainer:
        weights = trainer.get_weights()
        weights["model.norm.weight"][:3] = np.nan
        trainer.set_weights(weights)
        with pytest.raises(ValueError, match=r"the trainer has non-finite weights \(NaN or infinity\) in "
                                             r"model\.norm\.weight \(3 of \d+\): allow it \(export_model\(\.\.\., "
                                             r"allow_non_finite=True\)\)"):
            trainer.export_model(tmp_path / "refused")
        assert not os.path.exists(tmp_path / "refused")
        written = trainer.export_model(tmp_path / "allowed", allow_non_finite=True)
    assert np.isnan(dict(iter_weights(written))["model.norm.weight"][:3]).all()


def test_cli_export_explains_a_missing_checkpoint(tmp_path):
    from nanoq_cli.main import cli

    result = CliRunner().invoke(cli, ["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "no checkpoint at" in result.output and str(tmp_path / "nothing") in result.output
    result = CliRunner().invoke(cli, ["export", str(tmp_path), "-o", str(tmp_path / "out"),
                                      "--max-shard-size", "5XB"])
    assert result.exit_code == 2 and "5XB" in result.output
    assert not (tmp_path / "out").exists()


def test_export_checkpoint_writes_the_checkpointed_weights(checkpoints, tmp_path):
    pytest.importorskip("nanoq.checkpoint")
    from nanoq_cli.main import cli

    with open_trainer(checkpoints.path("qwen3")) as trainer:
        run_steps(trainer, [random_batch(np.random.default_rng(1), rows=2)], lr=1e-2)
        trainer.save_checkpoint(tmp_path / "ckpt", step=1)
        weights = trainer.get_weights()
        config = trainer.config
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "model")
    assert nanoq.ModelConfig.from_pretrained(out).to_core() == config.to_core()
    assert_same_tensors(dict(iter_weights(out)), weights, "exported checkpoint weight")

    result = CliRunner().invoke(cli, ["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "cli"),
                                      "--max-shard-size", "20KB"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(tmp_path / "cli" / "model.safetensors.index.json")
    assert_same_tensors(dict(iter_weights(tmp_path / "cli")), weights, "CLI-exported weight")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "model"), "-o", str(tmp_path / "bad")])
    assert result.exit_code == 1 and "cannot export" in result.output


def test_cli_export_takes_a_run_directory_and_names_the_step_it_exports(checkpoints, tmp_path):
    from nanoq_cli.main import cli

    root = tmp_path / "run" / "checkpoints"
    with open_trainer(checkpoints.path("qwen3")) as trainer:
        run_steps(trainer, [random_batch(np.random.default_rng(1), rows=2)], lr=1e-2)
        trainer.save_checkpoint(root, step=1)
        first = trainer.get_weights()
        run_steps(trainer, [random_batch(np.random.default_rng(2), rows=2)], lr=1e-2)
        trainer.save_checkpoint(root, step=2)
        second = trainer.get_weights()
    # A `latest` pointer left behind (a crash between a save's rename and its update) does not decide.
    (root / "latest").write_text("step_00000001")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-o", str(tmp_path / "newest")])
    assert result.exit_code == 0, result.output
    assert f"exporting {root / 'step_00000002'}, the newest valid checkpoint of {root}\n" in result.output
    assert_same_tensors(dict(iter_weights(tmp_path / "newest")), second, "exported step-2 weight")
    (root / "step_00000002" / "trainer_state.json").write_text("{ damaged")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-o", str(tmp_path / "model")])
    assert result.exit_code == 0, result.output
    assert (f"exporting {root / 'step_00000001'}, the newest valid checkpoint of {root} (passed over, not valid: "
            f"step_00000002)") in result.output
    assert_same_tensors(dict(iter_weights(tmp_path / "model")), first, "exported step-1 weight")


@pytest.mark.parametrize("declared, written", [(None, 16), (8, 16), (4096, 4096)])
def test_exported_context_is_the_declared_one_or_the_trained_seq_len(tmp_path, declared, written):
    config = nanoq.ModelConfig(**NANOQ_CONFIG["llama"], max_position_embeddings=declared)
    with nanoq.Trainer(config, nanoq.TrainOptions(backend="cpu", seq_len=16)) as trainer:
        out = trainer.export_model(tmp_path / "model")
    assert json.load(open(os.path.join(out, "config.json")))["max_position_embeddings"] == written


@pytest.mark.parametrize("index, message", [
    ('{"weight_map": ["model.safetensors"]}', "weight_map must map tensor names to shard file names"),
    ('{"weight_map": {"model.embed_tokens.weight": 3}}', "weight_map must map tensor names to shard file names"),
    ('{"metadata": {}}', "not a safetensors index"),
    ('[1, 2]', "not a safetensors index"),
    ('{"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}', "must be a plain file name"),
])
def test_a_malformed_safetensors_index_is_a_clear_error(tmp_path, index, message):
    from nanoq.hf_io import weight_files

    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=message):
        weight_files(tmp_path)


def test_a_pickled_model_or_a_peft_adapter_given_as_a_model_is_named_for_what_it_is(checkpoints, tmp_path):
    import shutil

    from nanoq_cli.main import cli

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(os.path.join(checkpoints.path("llama"), "config.json"), pickled / "config.json")
    torch.save({"model.norm.weight": torch.ones(4)}, pickled / "pytorch_model.bin")
    with open_trainer(checkpoints.path("llama")) as trainer:
        with pytest.raises(FileNotFoundError, match=r"holds neither model\.safetensors nor model\.safetensors\."
                                                    r"index\.json \(its pytorch_model\.bin is a pickle, which nanoq "
                                                    r"does not read: save the model as safetensors"):
            trainer.import_weights(str(pickled))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    result = CliRunner().invoke(cli, ["generate", str(adapter), "--prompt-ids", "1 2", "--backend", "cpu"])
    assert result.exit_code == 1 and f"{adapter} is a PEFT adapter (adapter_config.json), not a model" in \
        result.output, result.output
