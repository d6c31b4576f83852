"""`gpt2np profile`: profile a few training steps with the built-in profiler.

    gpt2np profile -e d12 -b 4 -t 64 --steps 2 [--device cpu|cuda|emu] [--out DIR]
                   [--precision tf32|fp32|bf16] [--views all|NAME,NAME...]
                   # at train.py's precision on the device unless --precision says
    gpt2np profile --plan --gpu H100 -e d12     # = gpt2np plan (gpt2np/cli/plan.py)

gpt2np.profiling.profiler records the steps. This prints the views of the last profiled step and
writes CSV, JSON, a Chrome trace, PNG plots and one CSV per view into --out.
"""
import sys

from gpt2np import backends
from gpt2np.cli import plan as plan_cli
from gpt2np.datasets.starter import resolve_model
from gpt2np.errors import ArgumentParser, BadInput, tool
from gpt2np.init import LLMC_INIT_SEED
from gpt2np.model import GPT2
from gpt2np.profiling import plan as planner
from gpt2np.profiling import profiler
from gpt2np.profiling.render import views
from gpt2np.profiling.render.report import EMULATED_NOTE

DESCRIPTION = ("Profile a few training steps: every op (NumPy) or kernel, copy and memset (CUDA), "
               "attributed to its layer, op, module and direction, with its time, FLOPs and bytes "
               "against the device's roofline.")


def parser() -> ArgumentParser:
    """The flags of `gpt2np profile`, --plan's among them."""
    ap = ArgumentParser(prog="gpt2np profile", description=DESCRIPTION)
    plan_cli.add_model_flags(ap, plan=False)
    ap.add_argument("--steps", type=int, default=1,
                    help="training steps to profile, after one unprofiled warm-up step (default 1)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "numpy", "cuda", "emu"],
                    help="where the steps run: cpu (= numpy), cuda (a GPU) or emu (the CUDA "
                         "kernels on the CPU emulator) (default auto: the GPU if there is one, "
                         "else the CPU)")
    ap.add_argument("--out", default="profile",
                    help="folder for CSV, JSON, trace and PNG (default ./profile)")
    ap.add_argument("--cpu-math", choices=["fast", "exact"],
                    help="on the CPU, as train.py's --cpu-math: fast = the fast C loops (default), "
                         "exact = bitwise the NumPy reference code")
    ap.add_argument("--views", default=",".join(views.DEFAULT_VIEWS),
                    help=f"views to print, comma-separated, or 'all' (default "
                         f"{','.join(views.DEFAULT_VIEWS)}; all: {','.join(views.VIEWS)})")
    ap.add_argument("--all-steps", action="store_true",
                    help="views of every profiled step, not the last")
    group = ap.add_argument_group("planning (gpt2np plan): no GPU needed, no kernel runs")
    group.add_argument("--plan", action="store_true",
                       help="plan one training step on --gpu: every launch with its FLOPs, bytes "
                            "and roofline floor, sums per op and direction, the memory the run "
                            "needs, the host syncs")
    plan_cli.add_plan_flags(group)
    return ap


def note(text) -> None:
    """A note on stderr (stdout holds the views)."""
    if text:
        print(f"note: {text}", file=sys.stderr)


def make_backend(args):
    """The backend of --device at --precision (default: the precision train.py trains in there)
    and --cpu-math; BadInput naming a flag the device does not take."""
    name = backends.resolve_name(args.device)
    here = f" (here {name})" if args.device == "auto" else ""
    if args.cpu_math and not backends.device_traits(name).has_cpu_math:
        raise BadInput(f"--cpu-math {args.cpu_math}: only for the CPU (numpy backend), not "
                       f"--device {args.device}{here}")
    precisions = backends.PRECISIONS[name]
    if args.precision and args.precision not in precisions:        # tf32 on the CPU
        raise BadInput(f"--precision {args.precision}: --device {args.device}{here} has no "
                       f"{args.precision}, only {' or '.join(precisions)}")
    precision, why = backends.resolve_precision(name, args.precision)
    note(why)
    math = {"math": args.cpu_math} if args.cpu_math else {}
    return backends.get_backend(name, precision=precision, **math)


def make_model(args, backend):
    """(model, description) of -e on `backend`, at -b, -t, --attention and -r (default: train.py's
    on that device)."""
    cfg, params, desc = resolve_model(args.model)
    plan_cli.check_seq_len(args.seq_len, cfg)
    head_size = cfg.channels // cfg.num_heads
    attention, why = backends.resolve_attention(backend, head_size, args.attention)
    note(why)
    recompute = args.recompute
    if recompute is None:
        recompute = planner.train_recompute(backends.resolve_name(args.device))
    seed = LLMC_INIT_SEED if params is None else None
    model = GPT2(cfg, backend, args.batch_size, args.seq_len, seed=seed, attention=attention,
                 recompute=recompute)
    if params is not None:
        model.load_params(params)
    return model, desc


def run(args) -> int:
    """Profile --steps steps after a warm-up step, print the views, write the files."""
    backend = make_backend(args)
    model, desc = make_model(args, backend)
    batches = planner.random_batches(model.cfg, args.batch_size, args.seq_len)
    prof = profiler.profile_steps(model, batches, args.steps)
    roof = profiler.device_roofline(backend)
    names = views.parse_views(args.views)
    step = None if args.all_steps else "last"
    print(profiler.report_text(prof, roof, names, step=step), end="")
    label = profiler.device_label(backend) + (f" ({EMULATED_NOTE})" if prof.emulated else "")
    title = f"{desc}, B={args.batch_size}, T={args.seq_len}, {backend.precision}, {label}"
    paths = profiler.write_outputs(prof, args.out, roof, title=title)
    print("wrote " + ", ".join(paths.values()))
    return 0


@tool
def main(argv=None) -> int:
    """Profile a few training steps and write the report (--plan: plan one); bad flags and files:
    one line, exit 2."""
    args = parser().parse_args(argv)
    plan_cli.check_flags(args)
    if args.plan:
        return plan_cli.plan_model(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
