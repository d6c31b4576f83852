"""The training loop, as llm.c's (train_gpt2.cu's main): before each step the evaluations and the
checkpoint that are due, then one step (gpt2np.train_step: forward, backward, AdamW), then its line.

A device step (CUDA) returns before the device has run it (train_step.PendingStep): its line comes
once the next step is queued, so that the host runs ahead of the device (gpt2np.train.log). A stop
signal ends the loop between two steps, or inside an evaluation, with a checkpoint of the step
reached.
"""
import os
import sys
import time

from gpt2np.profiling.profiler import Profiler, device_roofline, report_text, write_outputs
from gpt2np.train.checkpoints import write_checkpoint
from gpt2np.train.evaluate import evaluate_due
from gpt2np.train.interrupts import Stopped, StopSignals, signal_received
from gpt2np.train.log import report_pending, report_step
from gpt2np.train.schedule import learning_rate
from gpt2np.train.state import LoopState, Run, TrainedStep
from gpt2np.train_step import AdamW, NonFiniteError, PendingStep, train_step


def train_loop(run: Run, state: LoopState, signals: StopSignals):
    """Train from run.start_step to run.total_steps; SIGINT/SIGTERM stop it with a checkpoint
    (Stopped)."""
    cfg = run.cfg
    adamw = AdamW(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip)
    for step in range(run.start_step, run.total_steps + 1):
        last = step == run.total_steps
        stopping = signal_received(signals, run.dist)
        if state.pending and (stopping or last or busy(run, step)):   # the queued step's line first
            report_pending(run, state)
        if stopping:                              # between two steps: stop here, with a checkpoint
            stop_for_signal(run, state, signals, step)
        # at the resumed step, as llm.c: the evaluations run (again: main.log was trimmed of them),
        # not the checkpoint (a stop by signal writes its checkpoint before that step's evaluations)
        if not evaluate_due(run, step, signals):  # a stop signal ended an evaluation early
            stop_for_signal(run, state, signals, step)
        if run.checkpoint_due(step) and step != run.start_step:
            write_checkpoint(run, state, step)
        if last:
            break
        if cfg.profile_steps and step == run.start_step + 1:       # step start_step is the warm-up
            state.profiler = Profiler(run.backend, model=run.model).__enter__()
        take_step(run, state, adamw, step)
        if state.profiler and step in (run.start_step + cfg.profile_steps, run.total_steps - 1):
            end_profile(run, state)
    say_totals(run, state)


def busy(run: Run, step) -> bool:
    """Whether the loop does anything before training `step` (an evaluation, a sample, a
    checkpoint)."""
    return (run.val_due(step) or run.hellaswag_due(step) or run.sample_due(step)
            or run.checkpoint_due(step))


def take_step(run: Run, state: LoopState, adamw: AdamW, step):
    """Train `step` (train_step) and say its line, or, for a device step, the previous one's while
    it runs."""
    cfg, backend = run.cfg, run.backend
    lr = learning_rate(step, cfg.learning_rate, run.total_steps, cfg.warmup_steps,
                       cfg.final_lr_frac, cfg.lr_schedule)
    # the outlier limits from the steps up to step - 2: all a device step has read back by now
    limits = state.guard.limits(step) if state.guard.active else None
    if run.overfit:
        run.train_loader.reset()
    t0 = time.perf_counter()
    # A device step is timed by two events around its queueing: the first fires when the device gets
    # to it (after the previous step's work), the second after its last command, so their distance
    # is the step's time on the device also while the host runs ahead (host clocks between results
    # would then show the bursts in which results arrive, not the steps)
    span = None
    if backend.launches_kernels:
        span = (backend.event(), backend.event())
        span[0].record()
    try:
        result = train_step(run.model, run.train_loader.next_batch, step=step, lr=lr,
                            accum_steps=run.accum, adamw=adamw, dist=run.dist,
                            cuda_graphs=bool(cfg.cuda_graphs), limits=limits)
    except NonFiniteError as e:                   # the host step raises at once
        result = e
    if isinstance(result, PendingStep) and span is not None:
        span[1].record()
    else:
        span = None
    trained = TrainedStep(step, lr, result, t0, limits, span)
    if isinstance(result, PendingStep):   # a device step: the previous line while this one runs
        trained, state.pending = state.pending, trained
    if trained is not None:
        report_step(run, state, trained)


def stop_for_signal(run: Run, state: LoopState, signals: StopSignals, step):
    """Write the checkpoint of `step` (where this process trained something new and there is -o),
    say so in one line and exit 128 + the signal's number (Stopped)."""
    out_dir = run.cfg.output_dir
    if out_dir and step > run.start_step:
        write_checkpoint(run, state, step)
        what = f"checkpoint of step {step} written to {out_dir} (resume with -y 1)"
    elif not out_dir:
        what = "no -o, so nothing was saved"
    elif step:
        what = f"the checkpoint of step {step} in {out_dir} is the latest (resume with -y 1)"
    else:
        what = "nothing trained yet, nothing to save"
    if run.rank0:
        print(f"stopped by {signals.name} after {step} steps: {what}", file=sys.stderr, flush=True)
    raise Stopped(signals.exit_code)


def end_profile(run: Run, state: LoopState):
    """--profile's steps are done: the built-in profiler's report of them, and its files in -o (or
    ./profile)."""
    if state.pending:                             # its line before the report
        report_pending(run, state)
    profiler, state.profiler = state.profiler, None
    profiler.__exit__(None, None, None)
    if not run.rank0:
        return
    cfg = run.cfg
    roof = device_roofline(run.backend)
    print(report_text(profiler, roof), end="")   # profiling.views.DEFAULT_VIEWS of the last step
    title = f"{cfg.model}, B={cfg.batch_size}, T={cfg.seq_len}, {run.device_name}"
    folder = os.path.join(cfg.output_dir or ".", "profile")
    paths = write_outputs(profiler, folder, roof, title=title)
    print("profile written: " + ", ".join(paths.values()))


def say_totals(run: Run, state: LoopState):
    """llm.c's average step time (the first step, a warm-up, left out) and the outliers skipped."""
    if state.step_times:
        timed = state.step_times[1:] or state.step_times
        run.say(f"total average iteration time: {1e3 * sum(timed) / len(timed):f} ms")
    if state.guard.active:
        cfg = run.cfg
        run.say(f"updates skipped as outliers (-sl {cfg.skip_update_lossz:g} "
                f"-sg {cfg.skip_update_gradz:g}): {state.guard.skipped}")
