"""Training objectives (nanoq.data.objectives): how windows become (inputs,
targets) for causal, seq2seq and denoise training, checked against Nano's
definitions written out here, and the denoise draws' reproducibility."""
import numpy as np
import pytest

from nanoq.data.objectives import IGNORE_INDEX, corrupt, split_window, window_tokens


def split(objective, window, mask=None, seq_len=4):
    inputs = np.empty(seq_len, np.int32)
    targets = np.empty(seq_len, np.int32)
    split_window(objective, np.asarray(window, np.int32), mask, inputs, targets)
    return inputs.tolist(), targets.tolist()


def test_window_lengths_follow_nano():
    assert [window_tokens(o, 8) for o in ("causal", "seq2seq", "denoise")] == [9, 16, 8]
    with pytest.raises(ValueError, match="objective must be one of"):
        window_tokens("mlm", 8)


def test_causal_seq2seq_and_denoise_windows():
    assert split("causal", [1, 2, 3, 4, 5]) == ([1, 2, 3, 4], [2, 3, 4, 5])
    # Nano's non-causal task: x = ids[0:T], y = ids[T:2T].
    assert split("seq2seq", [1, 2, 3, 4, 5, 6, 7, 8]) == ([1, 2, 3, 4], [5, 6, 7, 8])
    # Denoise before corruption: the target is the original sequence.
    assert split("denoise", [1, 2, 3, 4]) == ([1, 2, 3, 4], [1, 2, 3, 4])


def test_masks_apply_to_the_token_each_target_predicts():
    mask = np.array([True, False, True, False, True, True, False, True])
    assert split("causal", [1, 2, 3, 4, 5], mask[:5])[1] == [IGNORE_INDEX, 3, IGNORE_INDEX, 5]
    assert split("seq2seq", list(range(1, 9)), mask)[1] == [5, 6, IGNORE_INDEX, 8]
    assert split("denoise", [1, 2, 3, 4], mask[:4])[1] == [1, IGNORE_INDEX, 3, IGNORE_INDEX]


def test_denoise_draws_are_a_function_of_seed_epoch_and_window():
    rows = np.arange(1, 1 + 6 * 64, dtype=np.int32).reshape(6, 64)
    first, again = rows.copy(), rows.copy()
    replaced = corrupt(first, [5, 9, 2, 7, 11, 3], mask_token=0, seed=3, epoch=1)
    corrupt(again, [5, 9, 2, 7, 11, 3], mask_token=0, seed=3, epoch=1)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first == 0, replaced)
    np.testing.assert_array_equal(first[~replaced], rows[~replaced])  # only replaced tokens change
    # A row's draw depends on its window only, not on its place in the batch.
    alone = rows[2:3].copy()
    corrupt(alone, [2], mask_token=0, seed=3, epoch=1)
    np.testing.assert_array_equal(alone[0], first[2])
    for other in (dict(seed=4, epoch=1), dict(seed=3, epoch=2)):
        changed = rows.copy()
        corrupt(changed, [5, 9, 2, 7, 11, 3], mask_token=0, **other)
        assert not np.array_equal(changed, first)


def test_denoise_ratio_is_uniform_per_window():
    # p ~ U(0, 1) per window, each token masked with probability p: over many
    # windows the masked fractions spread over [0, 1] with mean 1/2.
    rows = np.ones((2000, 256), dtype=np.int32)
    replaced = corrupt(rows, np.arange(2000), mask_token=7, seed=0, epoch=0)
    fractions = replaced.mean(axis=1)
    assert abs(fractions.mean() - 0.5) < 0.03
    counts, _ = np.histogram(fractions, bins=5, range=(0, 1))
    assert counts.min() > 300  # 400 expected in each fifth
    assert set(np.unique(rows)) == {1, 7}


def test_corrupt_checks_its_rows():
    with pytest.raises(ValueError, match="2 window indices for 3 rows"):
        corrupt(np.zeros((3, 4), np.int32), [0, 1], mask_token=1, seed=0, epoch=0)

