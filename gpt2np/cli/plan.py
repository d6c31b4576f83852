"""`gpt2np plan`: a roofline plan of one training step on a named GPU, without one.

    gpt2np plan --gpu H100 -e d12 [-b 4 -t 1024] [--precision tf32|fp32|bf16] [--plan-launches]
    gpt2np plan --measure --device cuda -e d12    # also runs the step: measured time by each floor

gpt2np.profiling.plan makes the plan. A plan takes train.py's settings on a GPU where no flag says
otherwise (-b, -t, attention, fused ops, -r). `gpt2np profile --plan` is the same plan: this module
also holds what profile shares with it, the model's flags and the checks made before any work.
"""
import argparse
import os
import sys

from gpt2np.backends import device_traits
from gpt2np.config import TrainConfig
from gpt2np.datasets.starter import resolve_model
from gpt2np.dist import launcher_rank, launcher_size
from gpt2np.errors import BAD_INPUT, ArgumentParser, BadInput, integer, tool
from gpt2np.profiling import plan as planner
from gpt2np.profiling.gpu_specs import lookup
from gpt2np.profiling.render import views

DESCRIPTION = ("Plan one training step on a GPU, without one: every launch with its FLOPs, bytes "
               "and roofline floor, sums per op and direction, the memory the run needs and the "
               "host syncs. No kernel runs unless --measure. Files: plan.csv, plan_ops.csv and "
               "plan.json in --out.")
# profile's -b and -t: train.py's
CPU_DEFAULTS = TrainConfig().with_device_defaults(device_traits("numpy"))


def recompute_help(plan: bool) -> str:
    """--recompute's help, with train.py's default (on a GPU for a plan)."""
    gpu, cpu = planner.train_recompute("cuda"), planner.train_recompute("numpy")
    default = f"{gpu}" if plan or gpu == cpu else f"{gpu} on a GPU and --plan, {cpu} on the CPU"
    return ("the model's recompute, as train.py's -r: 0 = keep every activation, 1 = recompute the "
            f"GELU in backward, 2 = the GELU and the LayerNorms (default: train.py's, {default})")


def precision_help(plan: bool) -> str:
    """--precision's help: the GEMMs planned, or the math of the profiled run."""
    if plan:
        return ("the GEMMs planned: tf32 tensor cores (default), fp32 CUDA cores, or bf16 (bf16 "
                "storage and tensor cores, fp32 master weights); a GPU without TF32 tensor cores "
                "plans fp32")
    return ("the math, as train.py's --precision: tf32 tensor cores, fp32 CUDA cores, or bf16 "
            "(bf16 storage and bf16 tensor cores, fp32 master weights; on the CPU bf16 storage, "
            "fp32 math) (default: train.py's on the device, tf32 on a GPU with tensor cores, else "
            "fp32; with --plan tf32)")


def add_model_flags(ap: ArgumentParser, plan: bool) -> None:
    """-e, -b, -t, --attention, --recompute and --precision, with a plan's defaults (plan) or
    profile's."""
    gpu, cpu = planner.GPU_DEFAULTS, CPU_DEFAULTS
    ap.add_argument("-e", "--model", dest="model", default="d12",
                    help="llm.c model file or preset (default d12)")
    ap.add_argument("-b", "--batch-size", dest="batch_size", type=int,
                    help=f"batch size B (default {gpu.batch_size if plan else cpu.batch_size})")
    seq_len = (f"{gpu.seq_len}, train.py's on a GPU" if plan
               else f"{cpu.seq_len}; with --plan {gpu.seq_len}, train.py's on a GPU")
    ap.add_argument("-t", "--seq-len", dest="seq_len", type=int,
                    help=f"sequence length T (default {seq_len})")
    attention = ("flash where the GPU has it, as train.py" if plan
                 else "flash on a GPU, the emulator and --plan; naive on the CPU")
    ap.add_argument("--attention", choices=["flash", "naive"],
                    help=f"the model's attention (default: {attention})")
    ap.add_argument("--recompute", "-r", type=int, choices=[0, 1, 2], help=recompute_help(plan))
    ap.add_argument("--precision", choices=["tf32", "fp32", "bf16"], help=precision_help(plan))


def add_plan_flags(ap) -> None:
    """--gpu, --plan-launches, --fuse, -ge and --measure: what only a plan takes."""
    ap.add_argument("--gpu", help="the GPU to plan for, as gpu_specs names it (H100, A100 80GB, "
                                  "L4, RTX 4090, ...; spaces, case and hyphens do not matter; "
                                  "default: the GPU measured with --measure, else H100)")
    ap.add_argument("--plan-launches", action="store_true", help="print every launch of the plan")
    ap.add_argument("--fuse", type=int, choices=[0, 1], default=1,
                    help="1 = the fused ops (GEMM epilogues, residual + LayerNorm, one-pass "
                         "LayerNorm backward), 0 = one kernel per op, as train.py's --fuse "
                         "(default 1)")
    ap.add_argument("-ge", "--gelu-fusion", dest="gelu_fusion", type=int, choices=[0, 1, 2],
                    help="with --fuse 1, as train.py's -ge: GELU in the fc GEMM's epilogue, 0 = "
                         "none, 1 = forward, 2 = forward and backward (default 2 with --fuse 1, "
                         "else 0)")
    ap.add_argument("--measure", action="store_true",
                    help="run the planned step for real (--device cuda, or emu: CPU times) and "
                         "print the measured time beside each floor")


def parser() -> ArgumentParser:
    """The flags of `gpt2np plan`; profile's other flags are taken too, unlisted, as profile --plan
    takes them."""
    ap = ArgumentParser(prog="gpt2np plan", description=DESCRIPTION)
    add_model_flags(ap, plan=True)
    add_plan_flags(ap)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "numpy", "cuda", "emu"],
                    help="with --measure: where the step runs, cuda (a GPU) or emu (the CPU "
                         "emulator) (default auto: the GPU if there is one)")
    ap.add_argument("--out", default="profile",
                    help="folder for plan.csv, plan_ops.csv and plan.json (default ./profile)")
    unlisted = argparse.SUPPRESS
    ap.add_argument("--plan", action="store_true", default=True, help=unlisted)
    ap.add_argument("--steps", type=int, default=1, help=unlisted)
    ap.add_argument("--cpu-math", choices=["fast", "exact"], help=unlisted)
    ap.add_argument("--views", default=",".join(views.DEFAULT_VIEWS), help=unlisted)
    ap.add_argument("--all-steps", action="store_true", help=unlisted)
    return ap


def check_one_process() -> None:
    """BadInput under mpiexec: each rank would profile alone and all write the same --out files."""
    if launcher_size() > 1:
        if launcher_rank() > 0:
            raise SystemExit(BAD_INPUT)             # rank 0 says why
        raise BadInput(f"gpt2np profile runs one process, not {launcher_size()} under mpiexec "
                       f"(each would profile alone into the same --out): profile a data-parallel "
                       f"run with `mpiexec -n N python train.py ... --profile STEPS`")


def check_flags(args) -> None:
    """The checks profile and plan make before any work: one process, sizes >= 1, planning flags
    only with --plan, no --cpu-math in a plan, known --views, an --out that can be a folder. -b and
    -t left out take their defaults: train.py's on a GPU for a plan, on the CPU for a profile."""
    check_one_process()
    defaults = planner.GPU_DEFAULTS if args.plan else CPU_DEFAULTS
    if args.batch_size is None:
        args.batch_size = defaults.batch_size
    if args.seq_len is None:
        args.seq_len = defaults.seq_len
    integer(1).check("-b", args.batch_size, "the batch size B")
    integer(1).check("-t", args.seq_len, "the sequence length T")
    integer(1).check("--steps", args.steps, "the number of profiled steps")
    planning = {"--gpu": args.gpu is not None, "--plan-launches": args.plan_launches,
                "--measure": args.measure, "--fuse": args.fuse != 1,
                "-ge": args.gelu_fusion is not None}
    if not args.plan and any(planning.values()):
        raise BadInput(f"{next(flag for flag, given in planning.items() if given)} needs --plan")
    if args.plan and args.cpu_math:
        raise BadInput(f"--cpu-math {args.cpu_math}: not with --plan (a plan is for a GPU)")
    views.parse_views(args.views)
    # before the run, not after it: the files go into --out
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise BadInput(f"--out {args.out}: is a file; expected a folder (made if missing)")


def check_seq_len(seq_len: int, cfg) -> None:
    """BadInput naming -t when T is longer than the model's context."""
    if seq_len > cfg.max_seq_len:
        raise BadInput(f"-t {seq_len}: longer than the model's max_seq_len {cfg.max_seq_len}")


def gpu_to_plan(args, backend) -> str:
    """The GPU to plan for: --gpu, else the GPU --measure runs the step on, else H100."""
    if args.gpu is not None or backend is None or not backend.on_gpu:
        return args.gpu or "H100"
    gpu = backend.device_name()
    if lookup(gpu) is None:
        raise BadInput(f"--measure on {gpu}: gpu_specs has no peak numbers for it; name the GPU to "
                       f"plan for with --gpu")
    return gpu


def run(args, cfg, params, desc) -> int:
    """Plan the step of model `cfg` (params: its weights, or None) as the flags say, print the plan
    and write its files; --measure also runs the step."""
    precision = args.precision or "tf32"
    if args.gelu_fusion and not args.fuse:
        raise BadInput(f"-ge {args.gelu_fusion} with --fuse 0: the GELU epilogues are fused GEMMs; "
                       f"give -ge 0 (or leave it out) with --fuse 0")
    planner.check_host_memory(args.batch_size, args.seq_len)
    backend = planner.measuring_backend(args.device, precision) if args.measure else None
    gpu = gpu_to_plan(args, backend)
    batches = planner.random_batches(cfg, args.batch_size, args.seq_len)
    recompute = planner.GPU_RECOMPUTE if args.recompute is None else args.recompute
    plan = planner.plan_step(cfg, args.batch_size, args.seq_len, gpu, precision, batches,
                             model_name=desc, attention=args.attention, fuse=bool(args.fuse),
                             recompute=recompute, gelu_fusion=args.gelu_fusion)
    if backend is not None:
        planner.check_measured_memory(plan, backend)
        planner.measure(plan, backend, params, batches)
    print(planner.render(plan, launches=args.plan_launches), end="")
    paths = planner.write_files(plan, args.out)
    print("wrote " + ", ".join(paths.values()))
    print(plan.total_line())
    return 0


def plan_model(args) -> int:
    """The plan of -e's model, after check_flags."""
    cfg, params, desc = resolve_model(args.model)
    check_seq_len(args.seq_len, cfg)
    return run(args, cfg, params, desc)


@tool
def main(argv=None) -> int:
    """Plan one training step; bad flags and files: one line, exit 2."""
    args = parser().parse_args(argv)
    check_flags(args)
    return plan_model(args)


if __name__ == "__main__":
    sys.exit(main())
