"""Plot training runs from their main.log files, as llm.c's dev/vislog.ipynb does.

    gpt2np plot log_d12                          # log_d12/main.log -> plot.png and plot.svg
    gpt2np plot log_a log_b -o cmp --baseline 124M    # two runs on one figure, GPT-2 124M lines

main.log holds llm.c's lines `s:STEP trl:LOSS [lr:.. norm:..]` (train loss), `s:STEP tel:LOSS` (val
loss) and `s:STEP eval:ACC` (HellaSwag accuracy). A step logged twice (a run resumed from an earlier
checkpoint) keeps its last value, as vislog does. Left panel: train and val loss of every run (log
scale); right panel, when any run logged one: HellaSwag accuracy. --baseline draws OpenAI's GPT-2
(and GPT-3) checkpoint values as dashed lines.
Needs matplotlib: pip install 'gpt2np[plot]'.
"""
import math
import sys
from pathlib import Path

from gpt2np.errors import ArgumentParser, BadInput, number, tool
from gpt2np.fileio import atomic_write, file_in_the_way

# llm.c vislog's reference values: OpenAI's GPT-2 checkpoints' val loss (FineWeb val) and HellaSwag
# accuracy; GPT-3's HellaSwag (the GPT-3 paper, as build-nanogpt plots it)
LOSS_BASELINE = {"124M": 3.424958, "350M": 3.083089, "774M": 3.000580, "1558M": 2.831273}
HELLA2_BASELINE = {"124M": 0.294463, "350M": 0.375224, "774M": 0.431986, "1558M": 0.488946}
HELLA3_BASELINE = {"124M": 0.337, "350M": 0.436, "774M": 0.510, "1558M": 0.547}
STREAMS = {"trl": "train loss", "tel": "val loss", "eval": "HellaSwag"}


def parse_log(path, skipped=None) -> dict:
    """{stream: ([steps], [values])} of a main.log, steps sorted, the last value of a step kept.
    skipped: a list to append the numbers (from 1) of the `s:` lines that could not be read to."""
    streams = {}
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such log file") from None
    for line_number, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or not parts[0].startswith("s:"):
            continue
        try:
            step = int(parts[0][2:])
            pairs = [part.split(":", 1) for part in parts[1:]]
            values = {key: float(value) for key, value in pairs}
        except ValueError:
            # a line cut short (a killed run) or another format: skip it
            if skipped is not None:
                skipped.append(line_number)
            continue
        for key, value in values.items():
            streams.setdefault(key, {})[step] = value
    return {key: tuple(map(list, zip(*sorted(by_step.items()))))
            for key, by_step in streams.items()}


def undrawn(streams, log_axis) -> list:
    """[(step, why)] of the values the figure leaves out, in step order: NaN and infinities
    (matplotlib draws no point for them), and losses <= 0 when the loss axis is logarithmic
    (HellaSwag's axis is linear)."""
    out = []
    for key, (steps, values) in streams.items():
        for step, v in zip(steps, values):
            if not math.isfinite(v):
                out.append((step, "NaN or infinite"))
            elif log_axis and key != "eval" and v <= 0:
                out.append((step, "a loss <= 0 on the log axis"))
    return sorted(out)


def find_log(run) -> Path:
    """RUN_DIR/main.log, or RUN itself when it is a file."""
    path = Path(run)
    if path.is_dir():
        path = path / "main.log"
        if not path.is_file():
            raise FileNotFoundError(f"{run}: no main.log in this folder (train with -o "
                                    f"{run} writes one)")
    elif not path.is_file():
        raise FileNotFoundError(f"{run}: no such run folder or log file")
    return path


def summary(label, streams) -> str:
    """One line per run: its last step and the best values, as vislog prints them."""
    # over the finite values (min/max would keep a NaN that comes first)
    def best(key, pick):
        finite = [v for v in streams[key][1] if math.isfinite(v)]
        return pick(finite) if finite else float("nan")

    parts = [label]
    if "trl" in streams:
        parts.append(f"last step {streams['trl'][0][-1]}, min train loss {best('trl', min):.4f}")
    if "tel" in streams:
        parts.append(f"min val loss {best('tel', min):.4f}")
    if "eval" in streams:
        parts.append(f"max HellaSwag {best('eval', max):.4f}")
    return ": ".join(parts[:2]) + (", " + ", ".join(parts[2:]) if len(parts) > 2 else "")


def plain_log_ticks(ax, bins=8):
    """Plain numbers (9, 9.5, 10) at "nice" values on ax's log y axis, about `bins` of them over its
    range: a short run's losses span less than a decade, where the log axis' own labels are one 10^1
    and a 9x10^0."""
    from matplotlib import ticker
    low, high = ax.get_ylim()
    if high > 10 * low:         # over a decade: 1, 2, 5 of each (0.5 1 2 5 10)
        locator = ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0))
    else:                       # within one: evenly spaced values (9 9.5 10 10.5 11)
        locator = ticker.MaxNLocator(nbins=bins, steps=[1, 2, 2.5, 5, 10])
    ticks = [v for v in locator.tick_values(low, high) if v > 0 and low <= v <= high]
    ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def draw_runs(runs, baseline=None, yscale="log", ylim_top=None, title=None):
    """The figure of the runs [(label, streams)]: loss, and HellaSwag when a run logged it, against
    steps."""
    try:            # the package itself first: some of its modules may be loaded already
        from matplotlib import ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'gpt2np[plot]'") from None
    hella = any("eval" in streams for _, streams in runs)
    fig = Figure(figsize=(16 if hella else 9, 6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if hella else 1, squeeze=False)[0]
    ax = axes[0]
    for i, (label, streams) in enumerate(runs):
        color = f"C{i}"
        if "trl" in streams:
            ax.plot(*streams["trl"], color=color, alpha=0.8, label=f"{label} train loss")
        if "tel" in streams:
            ax.plot(*streams["tel"], color=color, linestyle="-", marker="o", markersize=3,
                    linewidth=2, label=f"{label} val loss")
    if baseline:
        ax.axhline(y=LOSS_BASELINE[baseline], color="r", linestyle="--",
                   label=f"OpenAI GPT-2 ({baseline}) checkpoint val loss")
    ax.set_ylabel("loss")
    ax.set_yscale(yscale)
    if ylim_top is not None:
        ax.set_ylim(top=ylim_top)
    if yscale == "log":
        plain_log_ticks(ax)
    ax.set_title("Loss")
    if hella:
        ax = axes[1]
        for i, (label, streams) in enumerate(runs):
            if "eval" in streams:
                ax.plot(*streams["eval"], color=f"C{i}", marker="o", markersize=3, label=label)
        if baseline:
            ax.axhline(y=HELLA2_BASELINE[baseline], color="r", linestyle="--",
                       label=f"OpenAI GPT-2 ({baseline}) checkpoint")
            ax.axhline(y=HELLA3_BASELINE[baseline], color="g", linestyle="--",
                       label=f"OpenAI GPT-3 ({baseline}) checkpoint")
        ax.set_ylabel("accuracy")
        ax.set_title("HellaSwag eval")
    for ax in axes:
        ax.set_xlabel("steps")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, min_n_ticks=1))   # whole steps
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs, output, baseline=None, yscale="log", ylim_top=None, title=None):
    """Draw the runs [(label, streams)], write output.png and output.svg; returns the two paths."""
    fig = draw_runs(runs, baseline, yscale, ylim_top, title)
    output = Path(output)
    paths = [output.with_name(output.name + ".png"), output.with_name(output.name + ".svg")]
    for path in paths:          # whole files or none (a full disk left a cut-off plot.png)
        with atomic_write(path) as f:
            fig.savefig(f, format=path.suffix[1:], dpi=110)
    return paths


@tool
def main(argv=None):
    """Plot runs; a missing or empty log, a bad flag: one line, exit 2."""
    p = ArgumentParser(prog="gpt2np plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run folder (-o of train) or a main.log file")
    p.add_argument("-o", "--output", default="plot",
                   help="output path without extension: writes OUTPUT.png and OUTPUT.svg "
                        "(default ./plot)")
    p.add_argument("--labels",
                   help="comma-separated legend names, one per run (default: the folder names)")
    p.add_argument("--baseline", choices=sorted(LOSS_BASELINE, key=lambda s: float(s[:-1])),
                   help="draw OpenAI's GPT-2/GPT-3 values for this size (val loss on "
                        "FineWeb, HellaSwag)")
    p.add_argument("--yscale", default="log", choices=("log", "linear"),
                   help="loss axis (default log, as vislog)")
    p.add_argument("--ylim-top", type=float, help="upper limit of the loss axis (vislog: 4.0)")
    p.add_argument("--title", help="figure title")
    args = p.parse_args(argv)
    # losses are > 0, and a log axis has no place for 0 or below
    if args.ylim_top is not None:
        axis = "log-scaled loss axis" if args.yscale == "log" else "loss axis (losses are > 0)"
        number(0, low_open=True).check("--ylim-top", args.ylim_top, f"the top of the {axis}")
    logs = [find_log(run) for run in args.runs]
    labels = args.labels.split(",") if args.labels else [
        (path.parent.name or str(path.parent)) if path.name == "main.log" else path.stem
        for path in logs]
    if len(labels) != len(logs):
        raise BadInput(f"--labels {args.labels}: {len(labels)} names for {len(logs)} runs")
    runs, notes = [], []
    for label, path in zip(labels, logs):
        skipped = []
        streams = {k: v for k, v in parse_log(path, skipped).items() if k in STREAMS}
        if not streams:
            raise ValueError(f"{path}: no `s:STEP trl:LOSS`, `tel:` or `eval:` lines: not a "
                             "main.log of a run")
        if skipped:
            lines = ", ".join(map(str, skipped[:3])) + (", ..." if len(skipped) > 3 else "")
            notes.append(f"note: {path}: {len(skipped)} unreadable `s:` line(s) skipped (line "
                         f"{lines}; a run killed while writing, or another format)")
        missing = undrawn(streams, args.yscale == "log")
        if missing:
            steps = ", ".join(str(step) for step, _ in missing[:3]) + (", ..." if len(missing) > 3
                                                                       else "")
            why = "; ".join(dict.fromkeys(why for _, why in missing))
            notes.append(f"note: {path}: {len(missing)} value(s) not drawn (step {steps}: {why})")
        runs.append((label, streams))
    out = Path(args.output)
    if out.is_dir():
        out = out / "plot"
    # a file in the way of OUTPUT's folder: said before anything is drawn
    blocking = file_in_the_way(out)
    if blocking is not None:
        raise BadInput(f"-o {args.output}: {blocking} is a file; expected a folder (made if "
                       f"missing) for {out.name}.png and {out.name}.svg")
    for path in plot_runs(runs, out, args.baseline, args.yscale, args.ylim_top, args.title):
        print(f"wrote {path}")
    for label, streams in runs:
        print(summary(label, streams))
    # after the figure is written: an error above stays the one line
    for note in notes:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
