"""The training run behind train.py: llm.c's loop (validate, sample, checkpoint, step), any backend.

train(cfg) takes a TrainConfig (train.py maps llm.c's flags onto it); it prints llm.c's header and
one line per step, writes a log and checkpoints to -o, and resumes bit-identically with -y 1.

    setup        backend, model, data, the run folder (-o) and the checkpoint to resume, header
    loop         the evaluations and the checkpoint due, one step, its line; again
    evaluate     val loss, HellaSwag, a sample          checkpoints   save, rotate, resume
    log          header, step line, main.log            rundir        run folders
    interrupts   stop signals                           schedule      the learning rate

How a run ends other than by finishing: -o holding another run's checkpoints, -y 1 on another run's,
-> RunDirError before anything is written (gpt2np.train.rundir); a NaN/Inf loss or grad norm -> a
RuntimeError naming the step, the update not applied and no checkpoint written after it (or the step
skipped, --skip-nonfinite); -sl/-sg skip the update of an outlier step (gpt2np.outlier) and go on,
as llm.c does; SIGINT/SIGTERM -> the step (or the evaluation, cut short) ends, a checkpoint is
written to -o, exit 130/143 (gpt2np.train.interrupts). -x 0 trains nothing: it validates and samples
the model once and writes nothing.
"""
import warnings

from gpt2np.config import TrainConfig
from gpt2np.train.evaluate import evaluate_once
from gpt2np.train.interrupts import StopSignals
from gpt2np.train.loop import train_loop
from gpt2np.train.rundir import release_run_dirs
from gpt2np.train.setup import setup


def train(cfg: TrainConfig, dist=None, model_given=True):
    """Train as cfg says; returns the model. SIGINT/SIGTERM are caught for the whole run (see
    run_training). model_given False (no -e on the command line): a -y 1 resumes the model of the
    run in -o, as llm.c's -y 1 takes it from the checkpoint whatever -e says."""
    with StopSignals() as signals, warnings.catch_warnings():
        # a diverging run overflows inside NumPy a step before the NaN guard stops it: its one line
        # says enough
        warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) encountered",
                                RuntimeWarning)
        try:
            return run_training(cfg, dist, signals, model_given)
        except MemoryError as e:  # CuPy's OutOfMemoryError is one (the up-front check missed it)
            raise RuntimeError(f"out of memory ({' '.join(str(e).split()) or 'MemoryError'}): the "
                               f"model's parameters, gradients and AdamW moments (16 bytes a "
                               f"parameter in fp32) and the activations of -b x -t must fit; use a "
                               f"smaller -e, or a smaller -b (or -t) and -d to keep the tokens per "
                               f"step") from e
        finally:
            release_run_dirs()            # the -o lock prepare_run_dir took, held for the whole run


def run_training(cfg: TrainConfig, dist, signals: StopSignals, model_given=True):
    """Set the run up, then train it (or, with -x 0, evaluate the model once); returns the model."""
    run, state = setup(cfg, dist, model_given)
    if run.total_steps == 0:
        evaluate_once(run, signals)
        return run.model
    if run.start_step < run.total_steps:      # (a finished run resumed: setup's note says so)
        run.say(f"training for {run.total_steps} steps")
    train_loop(run, state, signals)
    return run.model
