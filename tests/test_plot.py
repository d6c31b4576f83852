"""gpt2np plot: main.log lines parsed as vislog does (a step logged again keeps its last value),
several runs on one figure written as PNG and SVG, HellaSwag's panel when a run logged `eval:`; bad
input: one line, exit 2."""
import pytest

from gpt2np.cli import plot

pytest.importorskip("matplotlib")

LOG_A = """s:0 tel:10.9512
s:0 trl:10.9871 lr:0.0003 norm:17.2
s:1 trl:9.5000 lr:0.0003 norm:12.3
s:2 trl:8.7000 lr:0.0003 norm:9.1
s:2 tel:8.9000
s:1 trl:9.4000 lr:0.0003 norm:12.0
s:2 trl:8.6000 lr:0.0003 norm:9.0
s:2 eval:0.2500
s:3 trl:8.1
s:3 tr
"""
LOG_B = """s:0 trl:11.0
s:1 trl:10.0
s:1 tel:10.5
"""


@pytest.fixture()
def runs(tmp_path):
    for name, text in (("run_a", LOG_A), ("run_b", LOG_B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "main.log").write_text(text)
    return tmp_path


def test_parse_keeps_the_last_value_of_a_step_and_skips_broken_lines(runs):
    skipped = []
    streams = plot.parse_log(runs / "run_a" / "main.log", skipped)
    assert skipped == [10]                          # `s:3 tr`, a line cut short
    assert streams["trl"] == ([0, 1, 2, 3], [10.9871, 9.4, 8.6, 8.1])
    assert streams["tel"] == ([0, 2], [10.9512, 8.9])
    assert streams["eval"] == ([2], [0.25])
    assert streams["norm"][1] == [17.2, 12.0, 9.0]


def test_two_runs_on_one_figure_png_and_svg(runs, capsys):
    out = runs / "figs" / "cmp"
    assert plot.main([str(runs / "run_a"), str(runs / "run_b" / "main.log"), "-o", str(out),
                      "--baseline", "124M", "--title", "two runs"]) == 0
    png, svg = runs / "figs" / "cmp.png", runs / "figs" / "cmp.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for label in ("run_a train loss", "run_a val loss", "run_b train loss", "HellaSwag eval",
                  "OpenAI GPT-2 (124M) checkpoint val loss"):
        assert label in text, label
    out_text = capsys.readouterr().out
    assert ("run_a: last step 3, min train loss 8.1000, min val loss 8.9000, max HellaSwag 0.2500"
            in out_text)
    assert "run_b: last step 1, min train loss 10.0000, min val loss 10.5000" in out_text


@pytest.mark.parametrize("yscale, drawn_out", [
    ("log", "3 value(s) not drawn (step 0, 2, 3: NaN or infinite; a loss <= 0 on the log axis)"),
    ("linear", "2 value(s) not drawn (step 0, 2: NaN or infinite)")])
def test_skipped_lines_and_undrawn_values_are_said(runs, capsys, yscale, drawn_out):
    """A line that cannot be read and values the figure cannot show (NaN, inf; a loss <= 0 on a log
    axis) are each one note on stderr, naming the log, instead of silently missing points; the
    summary's best values are the finite ones (a NaN first is not the minimum)."""
    log = runs / "run_c" / "main.log"
    log.parent.mkdir()
    log.write_text("s:0 trl:nan\ns:1 trl:10.5\ns:2 trl:inf\ns:3 trl:0.0\ns:4 tel:x\ns:5 trl:9.0\n")
    assert plot.main([str(log.parent), "-o", str(runs / "c"), "--yscale", yscale]) == 0
    res = capsys.readouterr()
    assert "run_c: last step 5, min train loss 0.0000" in res.out
    err = res.err.splitlines()
    assert err[0] == (f"note: {log}: 1 unreadable `s:` line(s) skipped (line 5; a run killed while "
                      "writing, or another format)")
    assert err[1] == f"note: {log}: {drawn_out}" and len(err) == 2
    capsys.readouterr()
    assert plot.main([str(runs / "run_b"), "-o", str(runs / "b")]) == 0    # a clean log: no notes
    assert capsys.readouterr().err == ""


def test_a_failed_write_leaves_no_cut_off_plot(runs, capsys, monkeypatch):
    """Each figure file is written whole or not at all: a full disk mid-write is one line naming the
    file, exit 1, and no plot.png is left behind."""
    import errno

    from matplotlib.figure import Figure

    def full_disk(fig, f, **kwargs):
        f.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    assert plot.main([str(runs / "run_a"), "-o", str(runs / "x")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: writing {runs / 'x.png'}: [Errno 28] No space left on device\n"
    assert not list(runs.glob("x.*")) and not list(runs.glob(".x.*"))


def test_without_matplotlib_one_line_names_the_extra(runs, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert plot.main([str(runs / "run_a"), "-o", str(runs / "x")]) == 2
    assert (capsys.readouterr().err == "error: plotting needs matplotlib: pip install "
                                       "'gpt2np[plot]'\n")


def test_no_hellaswag_one_panel_and_labels(runs, capsys):
    out = runs / "one"
    assert plot.main([str(runs / "run_b"), "-o", str(out), "--labels", "baseline", "--yscale",
                      "linear"]) == 0
    text = (runs / "one.svg").read_text()
    assert "baseline train loss" in text and "HellaSwag eval" not in text


@pytest.mark.parametrize("argv, expected", [
    (["missing_run"], ["missing_run", "no such run folder"]),
    (["empty"], ["empty", "no main.log"]),
    (["junk/main.log"], ["junk/main.log", "not a main.log"]),
    (["run_a", "--labels", "a,b"], ["--labels a,b", "2 names for 1 runs"]),
    (["run_a", "--baseline", "7B"], ["--baseline", "'7B'"]),
    ([], ["RUN_DIR"]),
    (["run_a", "--ylim-top", "nan"], ["--ylim-top nan", "log-scaled", "finite number > 0"]),
    (["run_a", "--ylim-top", "inf"], ["--ylim-top inf", "finite number > 0"]),
    (["run_a", "--ylim-top", "-1"], ["--ylim-top -1", "log-scaled", "> 0"]),
    (["run_a", "--ylim-top", "0", "--yscale", "linear"], ["--ylim-top 0", "> 0"]),
    (["run_a", "-o", "a.txt/fig"], ["-o a.txt/fig", "a.txt is a file"]),
])
def test_bad_input_is_one_line(argv, expected, runs, capsys, monkeypatch):
    monkeypatch.chdir(runs)
    (runs / "empty").mkdir()
    (runs / "junk").mkdir()
    (runs / "junk" / "main.log").write_text("hello\nworld\n")
    (runs / "a.txt").write_text("x")
    assert plot.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(piece in lines[0] for piece in expected), lines[0]


def visible_labels(ax, axis):
    """The tick labels matplotlib draws on ax's x or y axis (those within the view)."""
    ax.figure.canvas.draw()
    low, high = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    getter = ax.xaxis if axis == "x" else ax.yaxis
    ticks = zip(getter.get_major_ticks(), getter.get_majorticklocs())
    return [tick.label1.get_text() for tick, v in ticks if low <= v <= high]


@pytest.mark.parametrize("losses, expected", [
    ([10.99, 10.5, 9.8, 8.9], ["9", "9.5", "10", "10.5", "11"]),   # a short run: within one decade
    ([11.0, 6.0, 3.0, 0.4], ["0.5", "1", "2", "5", "10"]),         # over a decade
])
def test_a_short_run_gets_plain_loss_ticks_and_whole_steps(losses, expected):
    """The log loss axis is labelled in plain numbers, several of them (not one 10^1 and a minor
    9x10^0), and the steps axis in whole steps (not 0.5, 1.5)."""
    streams = {"trl": ([0, 1, 2, 3], losses), "tel": ([0, 3], [losses[0], losses[-1]])}
    fig = plot.draw_runs([("a", streams), ("b", {"eval": ([0, 3], [0.25, 0.26])})])
    loss_ax, hella_ax = fig.axes
    assert loss_ax.get_yscale() == "log"
    assert visible_labels(loss_ax, "y") == expected
    assert all(not t.get_text() for t in loss_ax.get_yticklabels(minor=True))
    for ax in (loss_ax, hella_ax):
        steps = visible_labels(ax, "x")
        assert steps and all(label.isdigit() for label in steps), steps
    assert visible_labels(loss_ax, "x") == ["0", "1", "2", "3"]
    fig = plot.draw_runs([("a", {"trl": ([0, 1, 2, 3], losses), "eval": ([3], [0.25])})])
    assert visible_labels(fig.axes[1], "x") == ["3"]         # one point: not 2.84 ... 3.16


def test_the_per_layer_chart_gives_every_op_a_colour_and_a_legend_beside_the_bars(tmp_path,
                                                                                  monkeypatch):
    """The profiler's time-per-layer chart (profiling/render/views.py) stacks more ops than the
    default colour cycle's 10: each op has a colour of its own, and the legend lists them all
    outside the bars."""
    import numpy as np
    from matplotlib.figure import Figure

    from gpt2np.backends.numpy.backend import NumpyBackend
    from gpt2np.config import GPT2Config
    from gpt2np.model import GPT2
    from gpt2np.profiling.profiler import profile_steps
    from gpt2np.profiling.render import views

    cfg = GPT2Config(16, 100, 128, 2, 2, 16)
    raw = np.random.default_rng(0).integers(0, 100, (2, 2, 9)).astype(np.int32)
    model = GPT2(cfg, NumpyBackend(threads=1), 2, 8, seed=0)
    profile = profile_steps(model, [(b[:, :-1], b[:, 1:]) for b in raw], steps=1).profile()
    figures, savefig = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    assert "layers.png" in views.write_plots(profile, None, str(tmp_path))
    ax = next(a for fig in figures for a in fig.axes
              if a.get_title().startswith("Time per layer and op"))
    ops = [c.get_label() for c in ax.containers]
    colors = [tuple(c.patches[0].get_facecolor()) for c in ax.containers]
    assert len(ops) > 10 and len(set(colors)) == len(ops), (ops, colors)
    assert all(len({tuple(p.get_facecolor()) for p in c.patches}) == 1 for c in ax.containers)
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ops
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    assert box.x0 >= ax.get_window_extent(renderer).x1          # beside the bars, not over them
    assert box.x1 <= ax.figure.bbox.x1 + 1                       # and inside the figure
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 8
