"""`nanoq plot`: the loss figure's panels (losses, learning rate) and its resume marks."""
import numpy as np
import pytest

from nanoq.plot import loss_figure, plot_losses
from nanoq.training import JsonlLog


def resumed_log():
    """Records of a run that logged steps 1-10, died, and resumed from its step-8 checkpoint to step 12."""
    records = [dict(type="start", time=0.0), dict(type="eval", step=0, loss=4.0)]
    records += [dict(type="train", step=s, loss=4.0 - 0.1 * s, lr=1e-3 * min(s, 4)) for s in range(1, 11)]
    records += [dict(type="eval", step=8, loss=3.3), dict(type="resume", step=8, time=1.0),
                dict(type="eval", step=8, loss=3.3)]
    records += [dict(type="train", step=s, loss=3.0 - 0.05 * s, lr=2e-3) for s in range(9, 13)]
    return records + [dict(type="eval", step=12, loss=2.5), dict(type="end", step=12)]


def test_loss_figure_has_a_loss_panel_an_lr_panel_and_marks_the_resume():
    import matplotlib.pyplot as plt

    records = resumed_log()
    figure = loss_figure(records, "run")
    losses, lr = figure.axes
    train, evals = (line for line in losses.lines if line.get_label() in ("train", "eval"))
    assert list(train.get_xdata()) == list(range(1, 13))
    # Steps 9 and 10 keep the resumed run's values, the ones it continued from.
    expected = [4.0 - 0.1 * s for s in range(1, 9)] + [3.0 - 0.05 * s for s in range(9, 13)]
    np.testing.assert_array_equal(train.get_ydata(), expected)
    assert list(evals.get_xdata()) == [0, 8, 12] and list(evals.get_ydata()) == [4.0, 3.3, 2.5]
    (rate,) = [line for line in lr.lines if line.get_label() == "lr"]
    assert list(rate.get_xdata()) == list(range(1, 13))
    np.testing.assert_array_equal(rate.get_ydata(), [1e-3 * min(s, 4) for s in range(1, 9)] + [2e-3] * 4)
    for axes in (losses, lr):
        marks = [line for line in axes.lines if line.get_linestyle() == "--"]
        assert [list(line.get_xdata()) for line in marks] == [[8, 8]]
    assert "resumed" in [text.get_text() for text in losses.get_legend().get_texts()]
    assert lr.get_ylabel() == "lr" and losses.get_ylabel() == "loss" and losses.get_title() == "run"
    plt.close(figure)


def test_plot_writes_the_figure_of_a_log_file(tmp_path):
    with JsonlLog(tmp_path / "log.jsonl") as log:
        for record in resumed_log():
            log.write(**record)
    import matplotlib.pyplot as plt

    mine = plt.figure()  # a caller's own figure stays open
    plot_losses(tmp_path / "log.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == [mine.number]
    plt.close(mine)
    (tmp_path / "empty.jsonl").write_text('{"type": "start"}\n')
    with pytest.raises(ValueError, match=r"empty\.jsonl: no train or eval losses to plot"):
        plot_losses(tmp_path / "empty.jsonl", tmp_path / "none.png")


def test_plot_errors_name_the_file_once_and_a_folder_without_a_log(tmp_path):
    from click.testing import CliRunner

    from nanoq_cli.main import cli

    (tmp_path / "bad.jsonl").write_text('{"type": "start"}\nnot json\n{"type": "end"}\n')
    with pytest.raises(ValueError) as caught:
        plot_losses(tmp_path / "bad.jsonl", tmp_path / "bad.png")
    assert str(caught.value) == f"{tmp_path / 'bad.jsonl'}:2: not a JSON line"
    result = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 1 and f"{tmp_path} holds no log.jsonl: give a run directory" in result.output
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "does not exist" in result.output
    # An image it cannot write: refused before drawing, as an error line.
    with JsonlLog(tmp_path / "log.jsonl") as log:
        for record in resumed_log():
            log.write(**record)
    for output, expected in ((tmp_path / "no" / "x.png", f"the folder {tmp_path / 'no'} does not exist"),
                             (tmp_path / "x.bmpx", "name an image file ending in one of ")):
        result = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(output)])
        assert result.exit_code == 1 and f"Error: cannot write {output}: {expected}" in result.output, result.output
        assert not output.exists()
    assert all(f".{name}," in result.output for name in ("pdf", "png", "svg")), result.output


def test_a_log_cut_off_mid_line_is_plotted_with_a_warning_naming_it(tmp_path):
    from click.testing import CliRunner

    from nanoq.training import read_log
    from nanoq_cli.main import cli

    # What a run killed while writing its sixth line leaves: five whole lines and part of one, no newline.
    whole = [dict(type="train", step=s, loss=4.0 - 0.1 * s, lr=1e-3) for s in range(1, 6)]
    path = tmp_path / "log.jsonl"
    with JsonlLog(path) as log:
        for record in whole:
            log.write(**record)
    with open(path, "a") as f:
        f.write('{"type": "train", "step": 6, "lo')
    with pytest.warns(UserWarning) as caught:
        assert read_log(path) == whole
    (warning,) = caught
    assert str(warning.message) == (f"{path}: skipped its last line 6, cut off before its newline (a run killed, or "
                                    f"still writing, mid-line)")
    result = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(tmp_path / "loss.png")])
    assert result.exit_code == 0, result.output
    assert f"warning: {path}: skipped its last line 6" in result.output
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_line_that_a_newline_ends_is_an_error_even_last(tmp_path):
    # A killed write never ends in a newline: a bad line with one, last or not, was not written by nanoq.
    for text, number in (('{"type": "start"}\n{"type": "train", "step": 1, "lo\n', 2),
                         ('{"type": "start"}\n{"type": "train", "step": 1, "lo\n{"type": "end"}', 2)):
        (tmp_path / "log.jsonl").write_text(text)
        with pytest.raises(ValueError) as caught:
            plot_losses(tmp_path / "log.jsonl", tmp_path / "loss.png")
        assert str(caught.value) == f"{tmp_path / 'log.jsonl'}:{number}: not a JSON line"
