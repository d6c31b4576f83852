"""`gpt2np nsys`: the profiler's views of an Nsight Systems SQLite export (gpt2np.profiling.nsys).

    nsys profile -t cuda,nvtx -o prof python train.py ...
    nsys export -t sqlite prof.nsys-rep
    gpt2np nsys prof.sqlite [--views all|NAME,...] [--step N|last|all] [--model d12]
                            [--csv OUT] [--json OUT] [--trace OUT] [--png OUT] [--out DIR]
"""
import os
import sys

from gpt2np.errors import ArgumentParser, integer, tool
from gpt2np.profiling import nsys
from gpt2np.profiling.gpu_specs import lookup, roofline
from gpt2np.profiling.render import report
from gpt2np.profiling.render import views as V

DEFAULT_VIEWS = ("kernels", "modules", "layers", "ops", "phases", "gpu_activities", "api_calls",
                 "user_ranges")
OUTPUT_FILES = ("--csv", "--json", "--trace", "--png")


def parser() -> ArgumentParser:
    """The flags of `gpt2np nsys`."""
    description = ("Attribute the kernels, copies and memsets of an nsys SQLite export to NVTX "
                   "ranges (step, direction, layer, op, GPT-2 module) and show the profiler's "
                   "views of it.")
    p = ArgumentParser(prog="gpt2np nsys", description=description)
    p.add_argument("report",
                   help="SQLite export of an Nsight Systems report (nsys export -t sqlite)")
    p.add_argument("--step", default="last",
                   help="step for the views: a number, 'last' (default) or 'all'")
    p.add_argument("--views",
                   help=f"views to print, comma-separated, or 'all' ({', '.join(V.VIEWS)}); "
                        f"default: {','.join(DEFAULT_VIEWS)}, the top kernels of the whole profile "
                        f"and the NVTX ranges projected onto the GPU")
    p.add_argument("--csv", help="write every activity's record to this CSV file")
    p.add_argument("--json", help="write the records, ranges and API calls to this JSON file "
                                  "(gpt2np report FILE --views all re-renders it)")
    p.add_argument("--trace",
                   help="write a Chrome/Perfetto trace JSON: kernels, copies, API calls, ranges")
    p.add_argument("--png", help="write a bar chart of time by op and direction")
    p.add_argument("--out",
                   help="folder for views.json, one CSV per view (views/) and the plots")
    p.add_argument("--device",
                   help="device for the peak numbers (default: the GPU named in the export)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                   help="the precision of the device's peak the kernels are held against "
                        "(default fp32)")
    p.add_argument("--model",
                   help="llm.c model descriptor (d12, gpt2:d24, gpt3:c768, ...) whose parameters "
                        "per module the module tree shows (an export does not know them)")
    p.add_argument("--short-names", action="store_true", help="use the kernels' short (base) names")
    p.add_argument("--top", type=int, default=20,
                   help="rows in the top-kernels summary (default 20)")
    return p


def check_outputs(args) -> None:
    """BadInput for an output path that cannot be written, before the export is read: a folder
    given for a file would fail only after the tables are printed."""
    for flag in OUTPUT_FILES:
        path = getattr(args, flag[2:])
        if path:
            report.check_output(flag, path)
    if args.out:
        report.check_output("--out", args.out, folder=True)


def step_title(what: str, records) -> str:
    """A title naming the step when the records are of one step."""
    steps = sorted({r.step for r in records if r.step is not None})
    return f"{what} of step {steps[0]}" if len(steps) == 1 else what


def text(args, profile, records, vprofile, roof, names, step) -> str:
    """The summary line, the views named and, without --views, the top kernels and the GPU
    projection of the NVTX ranges."""
    views = V.render_views(vprofile, roof, names, step=step).rstrip("\n")
    parts = [nsys.summary_line(profile), views]
    if not args.views:
        chosen = report.kernels_only(report.select_step(records, step))
        projected = nsys.gpu_projection([profile.activities[r.idx] for r in chosen])
        title = step_title("NVTX ranges projected onto the GPU (first kernel start to last kernel "
                           "end)", chosen)
        parts += [report.kernel_summary_table(report.kernels_only(records), top=args.top,
                                              title="Top kernels (whole profile)"),
                  report.range_table(projected, title)]
    return "\n\n".join(parts) + "\n"


def write_files(args, records, ranges, vprofile, roof, step, device) -> None:
    """The files --csv, --json, --trace, --png and --out ask for."""
    name = os.path.basename(args.report)
    if args.csv:
        with report.writing("--csv", args.csv):
            report.write_csv(records, args.csv, roof)
    if args.json:
        with report.writing("--json", args.json):
            report.write_json(records, args.json, roof, vprofile.meta | {"device": device},
                              V.profile_doc(vprofile))
    if args.trace:
        with report.writing("--trace", args.trace):
            report.write_chrome_trace(records, args.trace, ranges, process_name=f"nsys {name}",
                                      extra_events=V.trace_extra_events(vprofile))
    if args.png:
        with report.writing("--png", args.png):
            report.write_png(report.kernels_only(records), args.png,
                             title=f"{name}: time by op and direction")
    if args.out:
        with report.writing("--out", args.out):
            os.makedirs(args.out, exist_ok=True)
            paths = V.write_view_files(vprofile, roof, args.out, step=step)
            log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
            paths.update(V.write_plots(vprofile, roof, args.out, title=name, log=log, step=step))
        print("wrote " + ", ".join(paths.values()))


@tool
def main(argv=None) -> int:
    """The views (and files) of an nsys export; a bad export or flag: one line, exit 2."""
    args = parser().parse_args(argv)
    integer(1).check("--top", args.top, "the rows of the top-kernels summary")
    check_outputs(args)
    names = V.parse_views(args.views) if args.views else DEFAULT_VIEWS
    module_params = nsys.preset_parameters(args.model) if args.model else None
    step = report.parse_step(args.step)
    name_column = "shortName" if args.short_names else "demangledName"
    records, ranges, device, profile = nsys.read_report(args.report, name_column)
    report.check_step(records, step, args.report)
    device = args.device or device
    roof = None
    if args.device or (device and lookup(device) is not None):
        roof = roofline(device, args.precision)
    vprofile = nsys.views_profile(profile, records, args.precision, module_params)
    sys.stdout.write(text(args, profile, records, vprofile, roof, names, step))
    write_files(args, records, ranges, vprofile, roof, step, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
