"""Loaders under a launcher: process p of P serves only part (p, P) of every
global batch and reads only those rows' windows. The P parts together are
exactly the batches one process serves, in the same order, across epoch
boundaries and resumes; the position stays global. CPU only, tiny files."""

import numpy as np
import pytest

from nanoq.data import IGNORE_INDEX, Curriculum, DataLoader, Dataset, EvalLoader, MixtureLoader, write_tokens

SEQ = 4
ROWS = 12  # divisible into 1, 2, 3, 4 and 6 parts
PART_COUNTS = (1, 2, 3, 4, 6)


def ascending(directory, name, first, count):
    """A token file holding first, first + 1, ...: a window is named by its first token."""
    path = str(directory / name)
    write_tokens(path, np.arange(first, first + count), 1000)
    return path


class CountingDataset(Dataset):
    """A Dataset that records the window indices every read_windows call asks for
    (the only way a loader reads the token files)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = []

    def read_windows(self, indices, **draws):
        self.reads.append(np.asarray(indices).tolist())
        return super().read_windows(indices, **draws)


@pytest.fixture
def files(tmp_path):
    """17 windows of seq_len 4 (SEQ + 1 tokens, stepping by SEQ) in two files, 9 and 8
    of them: a 12-row batch crosses an epoch boundary every 17 windows."""
    ascending(tmp_path, "train_0.bin", 0, 9 * SEQ + 1 + 3)
    ascending(tmp_path, "train_1.bin", 500, 8 * SEQ + 1)
    return str(tmp_path / "train_*.bin")


def window_names(inputs):
    return inputs[:, 0].tolist()


def global_order(seed, windows, batches):
    """The windows of `batches` global batches, computed from the documented
    per-epoch permutations (independently of the loader's own code)."""
    stream = np.concatenate([np.random.default_rng([seed, epoch]).permutation(windows)
                             for epoch in range(batches * ROWS // windows + 1)])
    return [stream[k * ROWS:(k + 1) * ROWS].tolist() for k in range(batches)]


@pytest.mark.parametrize("count", PART_COUNTS)
def test_parts_together_are_the_single_process_batches_and_read_only_their_rows(files, count):
    whole = DataLoader(Dataset(files, SEQ), batch_rows=ROWS, seed=5, devices=ROWS)
    datasets = [CountingDataset(files, SEQ) for _ in range(count)]  # one per "process"
    parts = [DataLoader(datasets[p], batch_rows=ROWS, seed=5, devices=ROWS, part=(p, count)) for p in range(count)]
    order = global_order(5, len(datasets[0]), 6)  # 72 windows: four epochs of 17 begin inside a batch
    rows = ROWS // count
    for k in range(6):
        inputs, targets = whole.next_batch()
        served = [loader.next_batch() for loader in parts]
        assert all(part_inputs.shape == (rows, SEQ) for part_inputs, _ in served)
        assert np.array_equal(np.concatenate([i for i, _ in served]), inputs)
        assert np.array_equal(np.concatenate([t for _, t in served]), targets)
        for p, dataset in enumerate(datasets):
            assert dataset.reads[k] == order[k][p * rows:(p + 1) * rows]  # its rows' windows and nothing else
    assert all(len(dataset.reads) == 6 for dataset in datasets)
    assert all(loader.state_dict() == whole.state_dict() for loader in parts)  # the position is global
    assert whole.epoch == 4


def test_a_resume_on_another_process_count_continues_the_global_stream(files):
    whole = DataLoader(Dataset(files, SEQ), batch_rows=ROWS, seed=2)
    saved = DataLoader(Dataset(files, SEQ), batch_rows=ROWS, seed=2, part=(1, 2))
    for _ in range(2):
        whole.next_batch()
        saved.next_batch()
    state = saved.state_dict()
    assert state == whole.state_dict()
    resumed = [DataLoader(Dataset(files, SEQ), batch_rows=ROWS, seed=2, part=(p, 3)) for p in range(3)]
    for loader in resumed:
        loader.load_state_dict(state)
    for _ in range(3):
        inputs, _ = whole.next_batch()
        assert window_names(np.concatenate([loader.next_batch()[0] for loader in resumed])) == window_names(inputs)


@pytest.mark.parametrize("count", PART_COUNTS)
def test_eval_parts_together_are_the_single_process_batches_padding_included(files, count):
    whole = list(EvalLoader(Dataset(files, SEQ), batch_rows=ROWS))
    datasets = [CountingDataset(files, SEQ) for _ in range(count)]
    parts = [list(EvalLoader(datasets[p], batch_rows=ROWS, part=(p, count))) for p in range(count)]
    assert len(whole) == 2 and all(len(batches) == 2 for batches in parts)
    for k, (inputs, targets) in enumerate(whole):
        assert np.array_equal(np.concatenate([batches[k][0] for batches in parts]), inputs)
        assert np.array_equal(np.concatenate([batches[k][1] for batches in parts]), targets)
    # 17 windows: the second batch holds windows 12..16 and 7 rows of padding.
    assert np.all(whole[1][1][5:] == IGNORE_INDEX)
    rows = ROWS // count
    for p, dataset in enumerate(datasets):
        expected = [[w for w in range(k * ROWS + p * rows, k * ROWS + (p + 1) * rows) if w < 17] for k in range(2)]
        assert dataset.reads == expected


def test_mixture_and_curriculum_parts_together_are_the_single_process_batches(tmp_path):
    a = ascending(tmp_path, "a.bin", 0, 40 * SEQ + 1)  # 40 windows
    b = ascending(tmp_path, "b.bin", 500, 30 * SEQ + 1)  # 30 windows

    def curriculum(part):
        mixture = MixtureLoader([(DataLoader(Dataset(a, SEQ), ROWS, seed=1, part=part), 1.0),
                                 (DataLoader(Dataset(b, SEQ), ROWS, seed=2, part=part), 2.0)], seed=9)
        assert mixture.part == part
        return Curriculum([(mixture, EvalLoader(Dataset(b, SEQ), ROWS, part=part), 2),
                           (DataLoader(Dataset(a, SEQ), ROWS, seed=3, part=part), None, 2)], batches_per_step=2)

    whole = list(curriculum((0, 1)))
    parts = [list(curriculum((p, 3))) for p in range(3)]
    assert len(whole) == 8 and all(len(batches) == 8 for batches in parts)
    for k, (inputs, _) in enumerate(whole):
        assert window_names(np.concatenate([batches[k][0] for batches in parts])) == window_names(inputs)


def test_loaders_of_different_parts_do_not_mix(tmp_path):
    data = Dataset(ascending(tmp_path, "a.bin", 0, 40 * SEQ + 1), SEQ)  # 40 windows
    with pytest.raises(ValueError, match=r"same part.*\(0, 2\), \(1, 2\)"):
        MixtureLoader([(DataLoader(data, 4, seed=0, part=(0, 2)), 1.0),
                       (DataLoader(data, 4, seed=0, part=(1, 2)), 1.0)], seed=0)
    with pytest.raises(ValueError, match="train and eval loaders of a curriculum must serve the same part"):
        Curriculum([(DataLoader(data, 4, seed=0, part=(0, 2)), EvalLoader(data, 4), 1)])


@pytest.mark.parametrize("part,message", [
    ((2, 2), "0 <= index < count"),
    ((0, 0), "count >= 1"),
    ((0, 5), "batch_rows 12 is not divisible into 5 parts"),
    ((0,), "part must be \\(index, count\\)"),
    ((0.0, 2), "part must be \\(index, count\\)"),
    ("01", "part must be \\(index, count\\)"),
])
def test_a_bad_part_is_a_clear_error(files, part, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(Dataset(files, SEQ), batch_rows=ROWS, seed=0, part=part)
    with pytest.raises(ValueError, match=message):
        EvalLoader(Dataset(files, SEQ), batch_rows=ROWS, part=part)
