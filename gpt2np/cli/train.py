"""Train GPT-2 with gpt2np: llm.c's train_gpt2 flags, on the CPU (NumPy) or a GPU (CUDA + cuBLAS).

    gpt2np train                               # gpt2_124M.bin (offline: d12) on tinyshakespeare
    gpt2np train -e d12 -b 4 -t 64 -x 20 -o log124M
    gpt2np train -e log124M/model_00000020.bin ...   # any llm.c model file
    gpt2np train -o log124M -y 1               # resume the run in -o (its model, data and flags)
    mpiexec -n 8 gpt2np train -e d12 -z 1      # data parallel: 8 ranks (a GPU each), ZeRO-1

`python train.py` is the same command (llm.c's entry point, kept as a shim over this module).
"""
import argparse
import contextlib
import io
import sys
from dataclasses import fields

from gpt2np.config import TrainConfig, default_text, value_type
from gpt2np.dist import abort_job, launcher_rank
from gpt2np.errors import BAD_INPUT, BAD_INPUT_ERRORS, ArgumentParser, one_line_errors, tool


def build_parser():
    """llm.c's flags, one per TrainConfig field: flag, type, default, help and choices all come from
    TrainConfig."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       add_help=False)
    p.add_argument("--help", action="help", help="show this help message and exit")
    for f in fields(TrainConfig):
        meta, default = f.metadata, default_text(f)
        options = {"dest": f.name, "default": f.default,
                   "help": meta["help"] + (f" (default {default})" if default is not None else "")}
        if value_type(f) is bool:
            options["action"] = "store_true"
        else:
            options.update(type=value_type(f), choices=meta["choices"], metavar=meta["metavar"])
        if meta["flag"] == "-h":          # llm.c's -h takes 0/1 (HellaSwag); -h alone is still help
            options.update(nargs="?", action=HelpOrValue)
        p.add_argument(meta["flag"], **options)
    return p


class HelpOrValue(argparse.Action):
    """-h VALUE stores the value (llm.c's -h 0|1); a bare -h prints the help and exits, as
    everywhere else."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            parser.print_help()
            parser.exit()
        setattr(namespace, self.dest, values)


def parse_config(argv=None):
    """The TrainConfig the flags give, as parsed (TrainConfig.validate checks the values)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def model_flag_given(argv=None) -> bool:
    """Whether the command line names -e (--model): without it a -y 1 resumes the run's own model
    (run_model)."""
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return any(a in ("-e", "--model") or a.startswith("--model=")
               or (a.startswith("-e") and len(a) > 2 and not a.startswith("--")) for a in args)


@tool
def main(argv=None):
    """Parse and validate the flags, then train: bad flags or files end in one `error:` line and
    exit 2, a run that fails (a non-finite loss, a device, a write) in one line and exit 1."""
    # under mpiexec every rank parses the same flags: rank 0 alone says what is wrong
    if launcher_rank() > 0:
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                cfg = parse_config(argv).validate()
            except BAD_INPUT_ERRORS:
                raise SystemExit(BAD_INPUT) from None
    else:
        cfg = parse_config(argv).validate()
    # the trainer (backends, model, profiling) once the flags are good: a bad flag answers sooner
    from gpt2np.train.trainer import train
    # under mpiexec the other ranks must not wait for us: abort_job ends the job with the same code
    with one_line_errors(then=abort_job):
        train(cfg, model_given=model_flag_given(argv))
    return 0
