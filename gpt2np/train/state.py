"""What a training run reads (Run, set up once) and what its loop carries on (LoopState)."""
from dataclasses import dataclass, field
from typing import Callable

from gpt2np.config import TrainConfig
from gpt2np.datasets.data import DataLoader
from gpt2np.model import GPT2
from gpt2np.outlier import OutlierGuard
from gpt2np.profiling.profiler import Profiler


@dataclass
class Run:
    """The run as setup made it: settings, process group, backend, model, data, evaluations and log.
    """
    cfg: TrainConfig                  # with the device's defaults filled in
    dist: object                      # gpt2np.dist's process group (one process: a group of one)
    backend: object
    model: GPT2
    train_loader: DataLoader
    val_loader: DataLoader | None     # None: no validation (no -j, or -v 0)
    decoder: object                   # turns sampled tokens into text; None: no sampling (-s 0)
    hellaswag_examples: list | None   # this rank's share of HellaSwag's examples
    hellaswag_total: int              # every rank's together; 0: no HellaSwag
    logger: object                    # log.Logger: main.log
    start_step: int                   # the step resumed from (0: from scratch)
    total_steps: int
    total_batch: int                  # tokens per step, all processes together (-d)
    accum: int                        # micro-batches per step on each process
    overfit: bool                     # -a 1: the same batches every step
    say: Callable                     # print on rank 0, nothing elsewhere
    device_name: str
    flops_per_token: float
    model_desc: str                   # what the model is, in words (the header's "model" row)
    init_method: str                  # the header's weight init method (-e as given)
    train_pattern: str
    val_pattern: str | None
    attention: str                    # flash or naive
    cpu_math: str | None              # the numpy backend's fast or exact; None on other backends

    @property
    def rank0(self) -> bool:
        return self.dist.rank == 0

    def val_due(self, step) -> bool:
        """Whether the val loss runs before `step` (and after the last)."""
        last = step == self.total_steps
        return bool(self.val_loader) and (step % self.cfg.val_every == 0 or last)

    def hellaswag_due(self, step) -> bool:
        last = step == self.total_steps
        return bool(self.hellaswag_total) and (self.cfg.hellaswag_due(step) or last)

    def sample_due(self, step) -> bool:
        """Whether a sample is printed before `step`: every -s steps after 0, and after the last."""
        every = self.cfg.sample_every
        return bool(self.decoder) and step > 0 and (step % every == 0 or step == self.total_steps)

    def checkpoint_due(self, step) -> bool:
        """Whether -n writes a checkpoint of `step`: every -n steps after 0, and the last step's."""
        every = self.cfg.checkpoint_every
        return (bool(self.cfg.output_dir) and every > 0 and step > 0
                and (step % every == 0 or step == self.total_steps))

    def evaluated(self, step) -> tuple:
        """The kinds of main.log lines the loop writes at `step` (rundir.trim_log keeps the others
        at a resume)."""
        return ((("tel",) if self.val_due(step) else ())
                + (("eval",) if self.hellaswag_due(step) else ()))


@dataclass
class TrainedStep:
    """A step queued or done whose line is not out yet: its number, lr, result (a StepResult, a
    PendingStep of a device step, or the NonFiniteError of a host step), when it started, the
    outlier limits it ran with and the device events around it (None on the host)."""
    step: int
    lr: float
    result: object
    t0: float
    limits: tuple | None
    span: tuple | None


@dataclass
class LoopState:
    """What the loop carries from one step to the next."""
    guard: OutlierGuard               # recent losses and norms: z-scores, -sl/-sg's outliers
    nonfinite_skipped: int = 0        # non-finite steps skipped so far (--skip-nonfinite)
    last_saved: int | None = None     # the step of this run's newest checkpoint in -o
    pending: TrainedStep | None = None    # a device step whose line comes once the next is queued
    step_times: list = field(default_factory=list)    # seconds, one per step line
    last_report: float | None = None  # when the previous line's result arrived
    tok_s_ema: float = 0.0            # llm.c's smoothed tokens/s (from the run's second line on)
    profiler: Profiler | None = None  # while --profile's steps run
