"""`gpt2np ncu`: the kernel table of an Nsight Compute export (gpt2np.profiling.ncu reads it).

    bench/ncu.sh                   # one training step under ncu, NVTX-filtered, then this
    gpt2np ncu step.csv [--records builtin/profile.json] [--step N] [--device NAME]
                        [--csv OUT] [--json OUT]
    gpt2np ncu step.ncu-rep ...    # through the ncu-report package (pip install ncu-report)
"""
import os
import sys

from gpt2np.errors import ArgumentParser, BadInput, tool
from gpt2np.profiling import ncu
from gpt2np.profiling.gpu_specs import lookup, roofline
from gpt2np.profiling.render import report


def parser() -> ArgumentParser:
    """The flags of `gpt2np ncu`."""
    p = ArgumentParser(prog="gpt2np ncu",
                       description="Attribute Nsight Compute results to layer, op and direction.")
    p.add_argument("report", help="`ncu --csv` export (details or raw page) or .ncu-rep report")
    p.add_argument("--records",
                   help="gpt2np profile.json of the same configuration: aligned kernel by kernel")
    p.add_argument("--step", help="step of --records to align with (default last; needs --records)")
    p.add_argument("--device", help="device for the roofline (default: the one in the export)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                   help="precision of the GEMMs for the roofline (default fp32)")
    p.add_argument("--csv", help="write the attributed kernels to this CSV file")
    p.add_argument("--json", help="write the attributed kernels to this JSON file")
    return p


def profile_records(path, step_text):
    """The records of one step of the --records profile (step_text: --step, default the last)."""
    step = report.parse_step(step_text or "last")
    records, _, _ = report.read_json(path)
    report.require_records(records, path)
    report.check_step(records, step, path)
    return report.select_step(records, step)


def device_roofline(args, kernels):
    """(device, roofline or None): --device, else the first device of the export gpu_specs knows."""
    device = args.device or next((k.device for k in kernels if k.device and lookup(k.device)), None)
    if device and (args.device or lookup(device)):
        return device, roofline(device, "fp32", args.precision)
    return device, None


@tool
def main(argv=None) -> int:
    """The kernel table of an Nsight Compute export/report; a bad file or flag: one line, exit 2."""
    args = parser().parse_args(argv)
    if args.step is not None and not args.records:
        raise BadInput(f"--step {args.step}: needs --records (the step of that profile the kernels "
                       f"are aligned with); an ncu export has no step numbers")
    for flag in ("--csv", "--json"):
        path = getattr(args, flag[2:])
        if path:
            report.check_output(flag, path)
    kernels = ncu.read(args.report)
    records = profile_records(args.records, args.step) if args.records else None
    device, roof = device_roofline(args, kernels)
    out, matched = ncu.attribute(kernels, records)
    sys.stdout.write(ncu.render(args.report, kernels, out, matched, roof, args.records))
    meta = {"source": os.path.abspath(args.report), "device": device, "tool": "ncu"}
    if args.csv:
        with report.writing("--csv", args.csv):
            report.write_csv(out, args.csv, roof)
    if args.json:
        with report.writing("--json", args.json):
            report.write_json(out, args.json, roof, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
