"""The README's shell examples, so that they cannot drift from the code.

Every `nanoq ...` command of a ```bash block must parse: its subcommand and
flags exist. The blocks right after a `<!-- readme-test: run -->` line also
run, in README order and in one temporary folder, so each sees what the
blocks before it wrote; the folder starts with small stand-ins for the files
they name (books/, web.jsonl, chats.jsonl, a tokenizer in path/to/hf-model/,
my.toml, ...). `nanoq train` gets a tiny model and 2 steps on the cpu
backend, added after the README's own flags where the README gives none.
"""
import base64
import glob
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner

from nanoq.demo import DEMO_DIR
from nanoq_cli.main import cli

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
RUN_MARK = "<!-- readme-test: run -->"
# What a README `nanoq train` gets unless it gives the flag itself: small and quick.
SMALL_TRAIN = {"--hidden_size": "32", "--intermediate_size": "64", "--num_hidden_layers": "1",
               "--num_attention_heads": "2", "--seq_len": "16", "--batch_size": "2", "--threads": "1",
               "--backend": "cpu", "--steps": "2", "--eval_batches": "1"}


def shell_blocks(path=README):
    """(line number, run?, text) of every ```bash block of the README (or of the page at ``path``)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```bash":
            start = index + 1
            end = lines.index("```", start)
            marked = index > 0 and lines[index - 1].strip() == RUN_MARK
            blocks.append((start, marked, "\n".join(lines[start:end])))
            index = end
        index += 1
    return blocks


def shell_words(line):
    """The words of a shell line as bash would pass them: quotes removed,
    unquoted globs expanded (kept as they are when nothing matches), a
    comment dropped."""
    lexer = shlex.shlex(line, posix=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    words = []
    for word in lexer:
        if word[:1] in "\"'" and word[-1:] == word[:1]:
            words.append(word[1:-1])
        else:
            words += sorted(glob.glob(word)) or [word] if glob.has_magic(word) else [word]
    return words


def nanoq_commands(text):
    """The argument lists of the `nanoq` commands of a shell block (after a
    launcher such as mpiexec, between && and ;), comments and line
    continuations removed; globs are expanded in the working directory."""
    commands = []
    for line in text.replace("\\\n", " ").split("\n"):
        command = []
        for word in shell_words(line) + [";"]:
            if word in ("&&", ";", "|", "||"):
                if "nanoq" in command:
                    commands.append(command[command.index("nanoq") + 1:])
                command = []
            else:
                command.append(word)
    return commands


def parsed_command(args):
    """The click command that ``nanoq args`` names, its options parsed (no
    values converted, no files looked at): NoSuchOption for a flag it lacks."""
    command, context, name = cli, None, "nanoq"
    args = list(args)
    while True:
        context = click.Context(command, info_name=name, parent=context)
        _, rest, _ = command.make_parser(context).parse_args(args=args)
        if not isinstance(command, click.Group):
            return command
        name, args = rest[0], rest[1:]
        command = command.get_command(context, name)
        assert command is not None, f"no command {name!r}"


def test_the_readme_has_shell_examples_to_run():
    blocks = shell_blocks()
    assert len(blocks) > 10 and sum(marked for _, marked, _ in blocks) >= 4
    assert sum(len(nanoq_commands(text)) for _, _, text in blocks) > 20


@pytest.mark.parametrize("page", ["README.md", "docs/nano-migration.md", "docs/llmq-migration.md"])
def test_every_nanoq_command_in_the_readme_and_the_guides_parses(page):
    path = os.path.join(os.path.dirname(README), page)
    commands = 0
    for line, _, text in shell_blocks(path):
        for args in nanoq_commands(text):
            commands += 1
            try:
                parsed_command(args)
            except (click.UsageError, AssertionError) as e:
                pytest.fail(f"{page} line {line}: nanoq {shlex.join(args)}: {e}")
    assert commands, f"{page} has no nanoq command in a bash block"


def test_the_llmq_guide_names_nanoq_train_flags_that_exist():
    # Its flag table's nanoq column: each --flag must be one of nanoq train's options.
    with open(os.path.join(os.path.dirname(README), "docs", "llmq-migration.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("## The flags"):text.index("Without a nanoq counterpart")]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    flags = {flag for row in rows for flag in re.findall(r"--[a-z][a-z0-9-]*", row[2])}
    assert len(rows) > 25 and len(flags) > 30
    train = cli.get_command(click.Context(cli), "train")
    known = {option for param in train.params for option in param.opts}
    assert sorted(flags - known) == []


def with_small_training(args):
    if args[:1] != ["train"]:
        return args
    given = {word.split("=")[0].replace("-", "_") for word in args if word.startswith("--")}
    extra = [word for flag, value in SMALL_TRAIN.items() if flag.replace("-", "_") not in given
             for word in (flag, value)]
    return args + extra


def write_stand_ins(folder):
    """The files the README's runnable examples read."""
    (folder / "books").mkdir()
    words = "the quick brown fox jumps over the lazy dog by a river under tall trees".split()
    for book in range(2):
        paragraphs = [" ".join(words[(i + j) % 7:] + words[:(i + j) % 7]) + "." for i in range(40)
                      for j in range(book, book + 4)]  # long enough for windows of the default seq_len
        (folder / "books" / f"book{book}.txt").write_text("\n\n".join(paragraphs) + "\n")
    (folder / "web.jsonl").write_text("".join(json.dumps({"content": f"page {i}: {' '.join(words[i:])}"}) + "\n"
                                              for i in range(10)))
    model = folder / "path" / "to" / "hf-model"
    model.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(DEMO_DIR, name), model / name)
    chats = [{"prompt": f"Q: {word}?\nA:", "response": f" {word}."} for word in words] + \
        [{"messages": [{"role": "user", "content": word}, {"role": "assistant", "content": word.upper()}]}
         for word in words]
    (folder / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    lines = [base64.b64encode(pickle.dumps(list(range(i, i + 40)))).decode() for i in range(20)]
    (folder / "nano_lines.txt").write_text("\n".join(lines) + "\n")
    (folder / "my.toml").write_text('[data]\ntrain_data = "data/train_*.bin"\neval_data = "data/eval_*.bin"\n')


def test_the_marked_readme_examples_run(tmp_path, monkeypatch):
    write_stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran = []
    for line, marked, text in shell_blocks():
        if not marked:
            continue
        for args in nanoq_commands(text):
            args = with_small_training(args)
            result = CliRunner().invoke(cli, args, catch_exceptions=False)
            assert result.exit_code == 0, f"README.md line {line}: nanoq {shlex.join(args)}:\n{result.output}"
            ran.append(args[0])
    assert {"tokenize", "train", "plot", "memory"} <= set(ran)
    assert os.path.isfile(tmp_path / "nanoq-out" / "first" / "model" / "config.json")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert re.search(r"chat_template", (tmp_path / "sft" / "tokenizer_config.json").read_text())


# Standard-library modules nanoq may not use below the Python version that brought them.
NEWER_MODULES = {"tomllib": (3, 11)}


def test_the_python_version_the_readme_names_is_the_one_pyproject_requires_and_the_code_needs():
    import ast
    import tomllib

    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        required = tomllib.load(f)["project"]["requires-python"]
    lowest = tuple(int(part) for part in re.fullmatch(r">=(\d+)\.(\d+)", required).groups())
    with open(README, encoding="utf-8") as f:
        assert f"needs Python ≥ {lowest[0]}.{lowest[1]}," in f.read()
    shipped = [path for folder in ("pylib", "cli") for path in glob.glob(os.path.join(root, folder, "**", "*.py"),
                                                                        recursive=True)]
    assert len(shipped) > 20
    for path in shipped:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path, feature_version=lowest)  # syntax newer than `lowest` is refused
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                since = NEWER_MODULES.get(name.split(".")[0])
                assert since is None or since <= lowest, f"{path} imports {name} (Python {since}), below {required}"


def test_the_readmes_token_id_import_runs_and_trains(tmp_path):
    """The snippet that turns nanoGPT's uint16 train.bin/val.bin into token files, run as it
    is on small stand-ins: every id survives, and nanoq train takes the files."""
    import subprocess
    import sys

    text = open(README, encoding="utf-8").read()
    section = text[text.index("Token ids you already have"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    rng = np.random.default_rng(0)
    ids = {name: rng.integers(0, 50257, size, dtype=np.uint16) for name, size in (("train.bin", 5000),
                                                                                    ("val.bin", 700))}
    for name, array in ids.items():
        array.tofile(tmp_path / name)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from nanoq.data import TokenFile

    for split, name in (("train", "train.bin"), ("eval", "val.bin")):
        (written,) = sorted((tmp_path / "gpt2-data").glob(f"{split}_*.bin"))
        file = TokenFile(written)
        assert file.vocab_size == 50257 and np.array_equal(file.tokens, ids[name].astype(np.int32))
    args = ["train", "--train-data", str(tmp_path / "gpt2-data" / "train_*.bin"), "--eval-data",
            str(tmp_path / "gpt2-data" / "eval_*.bin"), "--out-dir", str(tmp_path / "runs"), "--sample-every", "0"]
    result = CliRunner().invoke(cli, with_small_training(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "vocab 50257" in result.output


def test_the_readmes_python_example_runs_as_written(tmp_path):
    """The "Using it from Python" example, run as it is (in a scratch folder, the
    cpu backend): it trains, the loss falls, and its export loads in transformers."""
    import subprocess
    import sys

    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Using it from Python"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(line.split()[1]) for line in done.stdout.splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")


def test_the_readmes_python_example_under_mpiexec_trains_like_one_process_of_two_devices(tmp_path):
    """As the README says, the same script under mpiexec -n 2: each process feeds its rows of
    every global batch (it fed the same rows to both and prepared the data twice at once)."""
    from test_processes import mpiexec_path

    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Using it from Python"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    assert "devices=1" in code
    (tmp_path / "mpi").mkdir()
    (tmp_path / "one").mkdir()
    (tmp_path / "mpi" / "example.py").write_text(code)
    (tmp_path / "one" / "example.py").write_text(code.replace("devices=1", "devices=2"))

    def losses(command, folder):
        done = subprocess.run(command + [sys.executable, "example.py"], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path / folder)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [float(line.split()[1]) for line in done.stdout.splitlines()]

    two_processes = losses([mpiexec_path(), "-n", "2"], "mpi")
    assert len(two_processes) == 20  # printed by the root process only
    # (Equal to fp32 rounding: each process takes the cores as its threads, the two devices of one share them.)
    np.testing.assert_allclose(two_processes, losses([], "one"), rtol=1e-4)


def test_prepare_reuses_its_own_demo_tokenization_so_the_python_example_can_run_again(tmp_path):
    from nanoq.demo import prepare

    first = prepare(tmp_path / "demo-data")
    files = {name: (tmp_path / "demo-data" / name).read_bytes() for name in os.listdir(tmp_path / "demo-data")}
    again = prepare(tmp_path / "demo-data")  # as the README's example does when it runs a second time
    assert again == first and first.output == str(tmp_path / "demo-data")
    assert {name: (tmp_path / "demo-data" / name).read_bytes() for name in files} == files
    assert sorted(os.listdir(tmp_path / "demo-data")) == sorted(files)
    assert prepare(tmp_path / "empty") is not None and (tmp_path / "empty" / "tokenize.json").is_file()


@pytest.mark.parametrize("when", ["__init__", "commit"])
def test_prepare_in_processes_at_once_takes_the_output_of_the_first_to_finish(tmp_path, monkeypatch, when):
    # The README's script under mpiexec: every process calls prepare() on one folder. The one that
    # finishes second found the folder taken, when it began writing or when it moved its own in, and
    # failed (OSError: Directory not empty); it now takes the first one's output.
    from nanoq import demo
    from nanoq.tokenization import pipeline

    target = tmp_path / "demo-data"
    original = getattr(pipeline.OutputDirectory, when)

    def the_other_process_first(self, *args):
        if not target.exists() or not os.listdir(target):
            subprocess.run([sys.executable, "-c", f"from nanoq.demo import prepare; prepare({str(target)!r})"],
                           check=True)
        return original(self, *args)

    monkeypatch.setattr(pipeline.OutputDirectory, when, the_other_process_first)
    result = demo.prepare(target)
    monkeypatch.undo()
    assert result == demo.prepare(target)  # the other process's output, complete
    assert os.listdir(tmp_path) == ["demo-data"]  # this process's own folder is gone


def test_prepare_refuses_a_directory_that_does_not_hold_its_demo_tokenization(tmp_path):
    from nanoq.demo import prepare

    prepare(tmp_path / "demo")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"does not hold the demo's tokenization \(it has no tokenize\.json\)"):
        prepare(tmp_path / "other")
    assert os.listdir(tmp_path / "other") == ["notes.txt"]  # never overwritten

    def changed(name, edit):
        copy = tmp_path / name
        shutil.copytree(tmp_path / "demo", copy)
        edit(copy)
        return copy

    def summary_with(**fields):
        def edit(copy):
            summary = json.loads((copy / "tokenize.json").read_text())
            (copy / "tokenize.json").write_text(json.dumps({**summary, **fields}))
        return edit

    cases = {
        "seed": (summary_with(seed=1), r"tokenize\.json has seed 1, the demo's is 0"),
        "inputs": (summary_with(inputs=["books.txt"]), r"inputs are \['books\.txt'\], not the demo corpus"),
        "tokenizer": (lambda copy: (copy / "tokenizer.json").write_text("{}"), r"tokenizer\.json is missing or "
                                                                             r"not the demo's"),
        "extra shard": (lambda copy: shutil.copyfile(copy / "train_000000.bin", copy / "train_000001.bin"),
                        r"train_\*\.bin files \['train_000000\.bin', 'train_000001\.bin'\] are not the ones"),
        "truncated": (lambda copy: os.truncate(copy / "eval_000000.bin", 2048), r"eval_000000\.bin.*truncated"),
        "tokens": (summary_with(train_tokens=5), r"its train files hold \d+ tokens, tokenize\.json says 5"),
    }
    for name, (edit, message) in cases.items():
        with pytest.raises(FileExistsError, match=message):
            prepare(changed(name, edit))


def test_submodules_the_docs_name_work_after_a_plain_import():
    import subprocess
    import sys

    code = ("import nanoq; nanoq.training.train; nanoq.hf_export.export_adapter; nanoq.checkpoint.read_state; "
            "nanoq.data.DataLoader; nanoq.demo.prepare; nanoq.lora.LoraConfig\n"
            "try:\n    nanoq.no_such_module\nexcept AttributeError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module 'nanoq' has no attribute 'no_such_module'"
