"""What a training run prints and logs: llm.c's header tables, its step line, and main.log in -o.

A device step's line (CUDA: gpt2np.train_step.PendingStep) is printed when the next step has been
queued (one step late), or before anything else the loop does (an evaluation, a sample, a
checkpoint, a stop), so that a non-finite step still stops the run before a checkpoint.
"""
import math
import os
import time
from dataclasses import dataclass

from gpt2np.dist import stop_together
from gpt2np.errors import WriteError
from gpt2np.fileio import append_line, atomic_write
from gpt2np.outlier import exceeded
from gpt2np.profiling.gpu_specs import mfu, peak_flops
from gpt2np.train.rundir import LOG_LINE
from gpt2np.train.state import LoopState, Run, TrainedStep
from gpt2np.train_step import NonFiniteError

PRECISION_TEXT = {"fp32": "fp32 (exact fp32 matmuls)",
                  "tf32": "tf32 (matmuls on TF32 tensor cores)",
                  "bf16": "bf16 (bf16 storage, fp32 math and AdamW state)"}
# the header's master weights row (llm.c's use_master_weights): bf16 with -w 1, with -w 0; fp32 and
# tf32 runs (their parameters are fp32: -w has no effect, as in llm.c) show it only when -w 0 was
# given
MASTER_WEIGHTS_TEXT = {1: "enabled (fp32 copy, AdamW updates it)",
                       0: "disabled (-w 0: AdamW updates the bf16 weights)",
                       "fp32": "-w 0 has no effect: the parameters are fp32"}


def header_table(rows, title=None):
    """llm.c's header tables: keys padded to 21 characters, values to 50. title=False: the rows and
    the closing line only (they follow the table before, as llm.c prints its later tables); else the
    opening lines first, with the key column headed `title` (llm.c's first table: "Parameter")."""
    width = max([21] + [len(k) for k, _ in rows])
    line = "+" + "-" * (width + 2) + "+" + "-" * 52 + "+"
    heading = f"| {title or 'Parameter':<{width}} | {'Value':<50} |"
    out = [] if title is False else [line, heading, line]
    out += [f"| {k:<{width}} | {str(v):<50} |" for k, v in rows]
    out.append(line)
    return "\n".join(out)


class Logger:
    """llm.c's main.log lines (s:STEP trl:LOSS ... / s:STEP tel:LOSS), appended, in -o.

    A line that cannot be written (disk full) stops the run with WriteError naming main.log: a run
    whose log silently ends is worse than one that stops. The log keeps whole lines only
    (fileio.append_line)."""

    def __init__(self, out_dir, rank, resume):
        self.path = os.path.join(out_dir, "main.log") if out_dir and rank == 0 else None
        # the first line of a resumed run may go before its step's kept lines
        self._resumed = resume
        if self.path:
            try:
                os.makedirs(out_dir, exist_ok=True)
                if not resume:
                    open(self.path, "w").close()
            except OSError as e:
                raise WriteError(self.path, e) from e

    def log(self, line):
        if not self.path:
            return
        first, self._resumed = self._resumed, False
        if not (first and self._insert_before_kept_eval(line)):
            append_line(self.path, line)

    def _insert_before_kept_eval(self, line) -> bool:
        """A resumed run's val line of step s goes before the HellaSwag lines of step s that
        main.log kept (the resumed run does not run HellaSwag at s again): llm.c's order, a step's
        val loss before its HellaSwag. Returns whether it did (main.log rewritten atomically)."""
        m = LOG_LINE.match(line)
        if not m or m.group(2) != "tel" or not os.path.isfile(self.path):
            return False
        with open(self.path) as f:
            lines = f.readlines()
        at = len(lines)
        while (at and (kept := LOG_LINE.match(lines[at - 1])) and kept.group(1) == m.group(1)
               and kept.group(2) == "eval"):
            at -= 1
        if at == len(lines):
            return False
        with atomic_write(self.path, "w") as f:
            f.writelines(lines[:at] + [line + "\n"] + lines[at:])
        return True


# ---- the header ----------------------------------------------------------------------------------
def print_header(run: Run):
    """llm.c's tables and lines (train_gpt2.cu's main), then gpt2np's own settings and the data's
    batches."""
    cfg, model, say = run.cfg, run.model, run.say
    say(header_table(llmc_settings_rows(run)))
    say(header_table(device_rows(run), title=False))
    say(header_table(model_rows(run), title=False))
    val_batches = run.val_loader.eval_batches(cfg.val_max_batches) if run.val_loader else 0
    say(header_table([("train_num_batches", run.total_steps), ("val_num_batches", val_batches)],
                     title=False))
    say(header_table([("run hellaswag", "yes" if run.hellaswag_total else "no")], title=False))
    say(header_table([("num_processes", run.dist.world_size), ("zero_stage", run.dist.zero_stage)],
                     title=False))
    param_bytes = model.num_parameters * model.params.dtype.itemsize
    B, T, processes = cfg.batch_size, cfg.seq_len, run.dist.world_size
    say(f"num_parameters: {model.num_parameters} => bytes: {param_bytes}")
    say(f"allocated {param_bytes // 2 ** 20} MiB for model parameters")
    say(f"batch_size B={B} * seq_len T={T} * num_processes={processes} and "
        f"total_batch_size={run.total_batch}")
    say(f"=> setting grad_accum_steps={run.accum}")
    if T < model.cfg.max_seq_len and run.backend.on_gpu:   # llm.c's CUDA trainer's warning
        say(f"WARNING: -t {T} is shorter than the model's max_seq_len {model.cfg.max_seq_len}: "
            f"the wpe rows from {T} on get no gradient (GPT-2 trains at -t 1024, GPT-3 at -t 2048)")
    say(header_table(gpt2np_settings_rows(run), title="gpt2np"))     # gpt2np's beside llm.c's
    say(f"train dataset num_batches: {run.train_loader.num_batches}")
    if run.val_loader:
        say(f"val dataset num_batches: {run.val_loader.num_batches}")


def llmc_settings_rows(run: Run) -> list:
    """llm.c's first table: its flags' values."""
    cfg, model = run.cfg, run.model
    overfit_val = run.overfit and run.val_pattern       # -a 1 reads the val shards: llm.c's too
    return [
        ("train data pattern", run.val_pattern if overfit_val else run.train_pattern),
        ("val data pattern", run.val_pattern or "-"), ("output log dir", cfg.output_dir or "NULL"),
        ("checkpoint_every", cfg.checkpoint_every), ("resume", cfg.resume),
        ("micro batch size B", cfg.batch_size), ("sequence length T", cfg.seq_len),
        ("total batch size", run.total_batch), ("LR scheduler", cfg.lr_schedule),
        ("learning rate (LR)", f"{cfg.learning_rate:e}"), ("warmup iterations", cfg.warmup_steps),
        ("final LR fraction", f"{cfg.final_lr_frac:e}"), ("weight decay", f"{cfg.weight_decay:e}"),
        ("skip update lossz", f"{cfg.skip_update_lossz:f}"),
        ("skip update gradz", f"{cfg.skip_update_gradz:f}"), ("max_steps", cfg.max_steps),
        ("val_loss_every", cfg.val_every), ("val_max_steps", cfg.val_max_batches),
        ("sample_every", cfg.sample_every), ("genT", cfg.gen_tokens),
        ("overfit_single_batch", cfg.overfit_single_batch),
        ("use_master_weights", "enabled" if cfg.master_weights else "disabled"),
        ("gelu_fusion", model.gelu_fusion), ("recompute", model.recompute)]


def device_rows(run: Run) -> list:
    """llm.c's device table: the device, its peak (a GPU's) and the precision."""
    backend = run.backend
    peak = peak_flops(run.device_name, backend.precision) if backend.launches_kernels else None
    emulated = backend.launches_kernels and not backend.on_gpu
    return [("device", backend.label if emulated else f"{backend.name} ({run.device_name})"),
            ("peak TFlops", f"{peak / 1e12:.1f}" if peak else "n/a"),
            ("precision", backend.precision.upper())]


def model_rows(run: Run) -> list:
    """llm.c's model table: where the weights come from, the sizes, the parameters."""
    model_cfg = run.model.cfg
    init = "intermediate checkpoint" if run.start_step else run.init_method
    return [("weight init method", init), ("max_sequence_length T", model_cfg.max_seq_len),
            ("vocab_size V", model_cfg.vocab_size),
            ("padded_vocab_size Vp", model_cfg.padded_vocab_size),
            ("num_layers L", model_cfg.num_layers), ("num_heads NH", model_cfg.num_heads),
            ("channels C", model_cfg.channels), ("num_parameters", run.model.num_parameters)]


def gpt2np_settings_rows(run: Run) -> list:
    """gpt2np's table: the settings llm.c's header does not show."""
    cfg, precision = run.cfg, run.backend.precision
    bf16 = precision == "bf16"
    rows = [("model", run.model_desc), ("grad clip", cfg.grad_clip), ("seed", cfg.seed),
            ("init seed", cfg.init_seed), ("shuffle", int(run.train_loader.shuffle)),
            ("precision", PRECISION_TEXT.get(precision, precision))]
    if run.cpu_math:
        rows.append(("cpu math", run.cpu_math))
    if bf16 or not cfg.master_weights:
        rows.append(("master weights", MASTER_WEIGHTS_TEXT[cfg.master_weights if bf16 else "fp32"]))
    return rows + [("attention", run.attention), ("fuse", int(run.model.fuse))]


# ---- the step line -------------------------------------------------------------------------------
def throughput_text(backend, flops_per_token, tok_s, processes, device_name) -> str:
    """The step line's throughput: with CUDA kernels llm.c's MFU, one process's tokens (tok_s /
    processes, all of them together) against one GPU's peak (n/a where the device has none: the
    emulator); on the CPU the GFLOP/s of all processes."""
    if backend.launches_kernels:
        util = mfu(flops_per_token, tok_s / processes, device_name, backend.precision)
        return f"{100 * util:.1f}% MFU" if util is not None else "MFU n/a"
    return f"{flops_per_token * tok_s / 1e9:.1f} GFLOP/s"


def gpu_memory_line(backend) -> str:
    """-lg's line, indented under the step line as llm.c's: the device's memory in use and its total
    (what the runtime can tell: the CPU emulator knows no device memory)."""
    total = getattr(backend.rt, "total_memory", None)
    free = backend.free_memory()
    if total is None or free is None:
        return "                  memory: not known (the CUDA emulator has no device memory)"
    total = total()
    used = total - free
    return (f"                  memory: {100 * used / total:.1f}% | {used / 2**30:.2f} GiB used of "
            f"{total / 2**30:.2f} GiB")


@dataclass
class StepOutcome:
    """What a step's line says of it."""
    loss: float
    norm: float
    applied: bool = True                  # False: not finite, and skipped (--skip-nonfinite)
    outlier: str | None = None            # "loss" or "norm": its update skipped (-sl/-sg)
    zscores: tuple = (math.nan, math.nan)     # the line's (llm.c's)
    outlier_zscores: tuple | None = None  # the ones the skip was decided on (see gpt2np.outlier)


def report_pending(run: Run, state: LoopState):
    """The line of the device step still queued, before anything else the loop does."""
    trained, state.pending = state.pending, None
    report_step(run, state, trained)


def report_step(run: Run, state: LoopState, trained: TrainedStep):
    """A trained step's line (llm.c's: loss, norm, lr, time, throughput, tokens/s) and its main.log
    line; a non-finite step is skipped (--skip-nonfinite, a line of its own) or stops the run."""
    outcome = step_outcome(run, state, trained)
    now = time.perf_counter()
    if trained.span is not None:          # a device step: its time on the device's own clock
        dt = run.backend.elapsed_ms(*trained.span) / 1e3
    else:                                 # queued steps: from the previous result to this one
        dt = now - max(trained.t0, state.last_report or trained.t0)
    state.last_report = now
    state.step_times.append(dt)
    tok_s = run.total_batch / dt
    # the line's tok/s is llm.c's: the first line's own rate, then an EMA (0.95) of the rates,
    # bias-corrected
    k = len(state.step_times) - 1
    state.tok_s_ema = 0.95 * state.tok_s_ema + 0.05 * tok_s if k else 0.0
    tok_s_shown = state.tok_s_ema / (1.0 - 0.95 ** k) if k else tok_s
    perf = throughput_text(run.backend, run.flops_per_token, tok_s, run.dist.world_size,
                           run.device_name)
    speed = f"{dt * 1e3:.2f} ms | {perf} | {tok_s_shown:.0f} tok/s"
    say_step_line(run, state, trained, outcome, speed)


def step_outcome(run: Run, state: LoopState, trained: TrainedStep) -> StepOutcome:
    """The step's loss and norm (a device step's are waited for here), into the outlier window; a
    non-finite step's update was not applied (the model is still the step's): skipped while
    --skip-nonfinite allows, else a RuntimeError naming the step and the checkpoint kept."""
    guard, step = state.guard, trained.step
    try:
        if isinstance(trained.result, NonFiniteError):
            raise trained.result
        loss, norm = trained.result
    except NonFiniteError as e:
        cfg, skipped = run.cfg, state.nonfinite_skipped
        if skipped >= cfg.skip_nonfinite:
            kept = (f"the last checkpoint, step {state.last_saved}, is untouched"
                    if state.last_saved else "no checkpoint was written" if cfg.output_dir
                    else "no -o, no checkpoint")
            more = (f" after skipping {skipped} (--skip-nonfinite {cfg.skip_nonfinite})" if skipped
                    else "")
            stop_together(run.dist)       # every rank sees the same averaged loss and global norm
            raise RuntimeError(f"{e}; stopping{more} ({kept})") from None
        state.nonfinite_skipped += 1
        return StepOutcome(e.loss, e.grad_norm, applied=False)
    # what the update was skipped for; the line's z-scores (llm.c's own numbers, over the window
    # before the step before) and those of the decision's window (one step late)
    outlier = exceeded(loss, norm, trained.limits) if trained.limits else None
    zscores = guard.zscores(step, loss, norm, lag=1)
    outlier_zscores = guard.zscores(step, loss, norm) if outlier else None
    guard.observe(step, loss, norm)
    guard.skipped += outlier is not None
    return StepOutcome(loss, norm, True, outlier, zscores, outlier_zscores)


def say_step_line(run: Run, state: LoopState, trained: TrainedStep, outcome: StepOutcome, speed):
    """The step line; an applied step's goes into main.log too (a skipped non-finite one changed
    nothing)."""
    cfg, say, step, lr = run.cfg, run.say, trained.step, trained.lr
    loss, norm = outcome.loss, outcome.norm
    head = f"step {step + 1:4d}/{run.total_steps} | loss {loss:.6f}"
    if not outcome.applied:
        say(f"{head} | norm {norm:.4f} | lr {lr:.2e} | skipped: not finite "
            f"({state.nonfinite_skipped} of --skip-nonfinite {cfg.skip_nonfinite})", flush=True)
        return
    # llm.c's line: the z-scores over the window (nan while it fills, the first 128 steps)
    z_loss, z_norm = outcome.zscores
    line = f"{head} ({z_loss:+.2f}z)| norm {norm:.4f} ({z_norm:+.2f}z)| lr {lr:.2e} | {speed}"
    if outcome.outlier:        # llm.c's line, then the step's; main.log keeps the loss (llm.c)
        loss_skipped = outcome.outlier == "loss"
        flag, limit = (("-sl", cfg.skip_update_lossz) if loss_skipped
                       else ("-sg", cfg.skip_update_gradz))
        z = outcome.outlier_zscores[0 if loss_skipped else 1]
        say(f"skipping update due to {'loss' if loss_skipped else 'grad'} z-score of {z:f}")
        line += (f" | skipped: {outcome.outlier} z-score {z:.2f} > {flag} {limit:g} "
                 f"({state.guard.skipped} outliers skipped)")
    say(line, flush=True)
    gpu_due = cfg.log_gpu_every > 0 and (step + 1) % cfg.log_gpu_every == 0
    if gpu_due and run.backend.launches_kernels:
        say(gpu_memory_line(run.backend), flush=True)
    run.logger.log(f"s:{step} trl:{loss:.4f} lr:{lr:.6f} norm:{norm:.2f}")   # llm.c's logger.h's
