"""`gpt2np report`: re-render a saved profile (profile.json, or the --json of nsys and ncu).

    gpt2np report prof/profile.json [--step N|last|all] [--device NAME] [--precision fp32]
    gpt2np report prof/profile.json --views all|NAME,...

Without --views: the text report of gpt2np.profiling.render.report (kernel table, module tree,
per-layer and per-op totals, top kernels, ranges); with --views: the profiler's views
(gpt2np.profiling.render.views).
"""
import sys

from gpt2np.errors import ArgumentParser, tool
from gpt2np.profiling.gpu_specs import roofline
from gpt2np.profiling.render import report, views

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def parser() -> ArgumentParser:
    """The flags of `gpt2np report`."""
    p = ArgumentParser(prog="gpt2np report",
                       description="Render the profiling report of a JSON records file.")
    p.add_argument("records",
                   help="JSON file written by gpt2np.profiling.render.report.write_json")
    p.add_argument("--step", default="last",
                   help="step to show: a number, 'last' (default) or 'all'")
    p.add_argument("--device", help="device for the roofline (default: the one in the file)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="with --device: the precision of its peak that the hand-written kernels "
                        "are held against (default fp32, the CUDA cores)")
    p.add_argument("--matmul-precision", choices=PRECISIONS,
                   help="with --device: the precision of its peak that the GEMMs are held against "
                        "(default: --precision)")
    p.add_argument("--views",
                   help="the profiler's views instead of the kernel report: comma-separated names "
                        "or 'all' (see gpt2np.profiling.render.views)")
    return p


@tool
def main(argv=None) -> int:
    """Render the report of a JSON records file; a bad file or flag: one line, exit 2."""
    args = parser().parse_args(argv)
    step = report.parse_step(args.step)
    profile, roof = views.read_profile(args.records)    # the file parsed once, every part checked
    records, meta = profile.records, profile.meta
    report.require_records(records, args.records)
    report.check_step(records, step, args.records)
    if args.device:
        roof = roofline(args.device, args.precision, args.matmul_precision)
    if args.views:
        names = views.parse_views(args.views)
        sys.stdout.write(views.render_views(profile, roof, names, step=step))
        return 0
    saved = [(r.name, r.start_ns, r.end_ns) for r in views.select(profile, step).ranges]
    sys.stdout.write(report.render(records, roof, step, ranges=saved or None,
                                   num_layers=meta.get("num_layers"),
                                   note=report.profile_note(meta),
                                   params=meta.get("module_params")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
