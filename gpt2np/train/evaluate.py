"""A training run's evaluations: val loss (`tel`, gpt2np eval's too), HellaSwag (`eval`), samples.

The val loss and HellaSwag run in pieces (a batch; a batch's worth of examples) and ask
should_stop() before each, so that a stop signal during a long evaluation ends it within a piece:
the caller then writes its checkpoint without the evaluation's numbers.
"""
import contextlib
import functools
import math
import os
import sys

from gpt2np import ranges
from gpt2np.config import TrainConfig
from gpt2np.datasets import hellaswag
from gpt2np.datasets.cache import cached
from gpt2np.errors import BadInput, one_line
from gpt2np.generate import generate
from gpt2np.progress import progress
from gpt2np.rng import LlmcCoins
from gpt2np.train.interrupts import Stopped, StopSignals, signal_received
from gpt2np.train.state import Run

LONG_VALIDATION = 100     # batches from which a validation shows its progress (-m -1, big val sets)


def eval_loss(model, loader, max_batches=-1, desc="val", quiet_below=0, should_stop=None):
    """(mean loss, batches) over the first max_batches batches of the loader from its start, as
    training's val loss counts them (-1: llm.c's count; more than there are wraps around:
    DataLoader.eval_batches), with a progress bar when there are quiet_below batches or more
    (training's val loss: only for a long one). should_stop(), asked before each batch, True: (None,
    the batches done)."""
    loader.reset()
    n = loader.eval_batches(max_batches)
    total = 0.0
    with progress(total=n, desc=desc, unit="batch", quiet=n < quiet_below) as bar:
        for _ in range(n):
            if should_stop is not None and should_stop():
                return None, bar.n
            x, y = loader.next_batch()
            total += model.forward(x, y)
            bar.update(1)
            bar.set_postfix_str(f"loss {total / bar.n:.4f}", refresh=False)
    return total / max(n, 1), n


def val_loss(model, loader, max_batches, show_progress=True, should_stop=None):
    """Mean loss over max_batches validation batches from the loader's start (-1: llm.c's count, all
    the tokens' worth; more than there are wraps around to the first again, as llm.c's -m does); a
    long one shows a progress bar on stderr (plain lines when stderr is not a terminal). None when
    should_stop() said stop."""
    quiet_below = LONG_VALIDATION if show_progress else math.inf
    with ranges.range("validation"):
        return eval_loss(model, loader, max_batches, quiet_below=quiet_below,
                         should_stop=should_stop)[0]


def load_hellaswag(cfg: TrainConfig, model_cfg, dist, say=print):
    """--hellaswag (or -h 1): this rank's share of the rendered examples and the total count, or
    (None, 0). Data that cannot be had stops the run for --hellaswag; for -h 1 it is a note and no
    evaluation, as llm.c's -h 1 skips HellaSwag when its file is missing. The ranks decide that
    together (one collective): HellaSwag's scoring is a collective too, so either every rank
    evaluates or none does."""
    if cfg.hellaswag_interval <= 0:
        return None, 0
    flag = "-h 1" if cfg.hellaswag_eval else "--hellaswag"
    if model_cfg.vocab_size < 50257:
        raise ValueError(f"{flag}: the model's vocab_size is {model_cfg.vocab_size}; HellaSwag is "
                         f"tokenized with GPT-2's 50257 tokens")
    examples, problem = None, None
    try:
        _, examples = hellaswag.load(cfg.hellaswag_data)
    except (OSError, ValueError) as e:        # no file, an offline download, an unreadable file
        path = cfg.hellaswag_data
        if (path and isinstance(e, (FileNotFoundError, IsADirectoryError))    # the file itself
                and (not os.path.exists(path) or os.path.isdir(path))):
            what = ("no such file" if isinstance(e, FileNotFoundError)
                    else "a folder, not a HellaSwag .jsonl file")
            e = BadInput(f"--hellaswag-data {path}: {what}")
        if not cfg.hellaswag_eval:
            raise e from None
        problem = one_line(e)
    if not cfg.hellaswag_eval:
        return examples[dist.rank::dist.world_size], len(examples)
    if problem is not None:
        where = f"rank {dist.rank} of {dist.world_size}: " if dist.world_size > 1 else ""
        print(f"note: {where}-h 1: no HellaSwag data ({problem})")
    if dist.average(0.0 if problem else 1.0) < 1.0:  # a rank without the data: none evaluates
        say("note: -h 1: skipping HellaSwag's evaluation, as llm.c does without its data (fetch it "
            "once with `gpt2np eval hellaswag`, or give --hellaswag-data PATH)")
        return None, 0
    return examples[dist.rank::dist.world_size], len(examples)


def prefetch_hellaswag(cfg: TrainConfig):
    """Rank 0, alone, before the others start: the HellaSwag file into the download cache, so that
    the ranks do not all download it at once (they read the cached copy in load_hellaswag). A
    failure is load_hellaswag's to report."""
    if cfg.hellaswag_interval > 0 and cfg.hellaswag_data is None:
        try:
            cached(hellaswag.VAL_FILE)
        except (OSError, ValueError):
            pass


def evaluate_hellaswag(model, examples, total, dist, should_stop=None):
    """(correct, total): acc_norm's count over every rank's examples (llm.c's number), each rank
    scoring its share B examples at a time (4B rows: the very batches one score() of the whole share
    makes), asking should_stop() before each piece (every rank as often: as many pieces as the
    largest share has); None when it said stop."""
    largest_share = -(-total // dist.world_size)
    correct = 0
    with ranges.range("hellaswag"):
        for lo in range(0, largest_share, model.B):
            if should_stop is not None and should_stop():
                return None
            piece = examples[lo:lo + model.B] if examples else []
            if piece:
                correct += hellaswag.score(model, piece).correct_norm
    return round(dist.average(float(correct)) * dist.world_size), total


def sample_text(model, decoder, cfg: TrainConfig) -> str:
    """llm.c's training sample: from the EOT token, -g - 1 new tokens (llm.c's genT counts the EOT),
    one coin a token from llm.c's xorshift state, set to --seed (llm.c's 1337) for every sample."""
    tokens = generate(model, [decoder.eot_token], cfg.gen_tokens - 1, LlmcCoins(cfg.seed),
                      cfg.temperature, cfg.top_k)
    return "generating:\n---\n" + decoder.decode(tokens[1:]) + "\n---"


# ---- in a run ------------------------------------------------------------------------------------
def evaluate_due(run: Run, step, signals: StopSignals) -> bool:
    """The evaluations due before `step`: the val loss, HellaSwag, then a sample (rank 0). False
    when a stop signal ended one early (under mpiexec every rank looks at the same points,
    signal_received)."""
    should_stop = functools.partial(signal_received, signals, run.dist)
    if run.val_due(step) and not say_val_loss(run, step, should_stop):
        return False
    if run.hellaswag_due(step) and not say_hellaswag(run, step, should_stop):
        return False
    if run.rank0 and run.sample_due(step):
        run.say(sample_text(run.model, run.decoder, run.cfg))
    return True


def say_val_loss(run: Run, step, should_stop=None) -> bool:
    """llm.c's val loss line, averaged over the ranks, and main.log's `tel` line (step None: none);
    False when should_stop() ended it early."""
    loss = val_loss(run.model, run.val_loader, run.cfg.val_max_batches, show_progress=run.rank0,
                    should_stop=should_stop)
    if loss is None:
        return False
    loss = run.dist.average(loss)
    run.say(f"val loss {loss:.6f}")
    if step is not None:
        run.logger.log(f"s:{step} tel:{loss:.4f}")
    return True


def say_hellaswag(run: Run, step, should_stop=None) -> bool:
    """llm.c's HellaSwag line and main.log's `eval` line (step None: none); False when should_stop()
    ended it."""
    scored = evaluate_hellaswag(run.model, run.hellaswag_examples, run.hellaswag_total, run.dist,
                                should_stop)
    if scored is None:
        return False
    correct, total = scored
    run.say(f"HellaSwag: {correct}/{total} = {correct / total:.6f}")
    if step is not None:
        run.logger.log(f"s:{step} eval:{correct / total:.4f}")
    return True


def evaluate_once(run: Run, signals: StopSignals):
    """-x 0: validate, HellaSwag and sample the model once; -o is not written. Nothing to
    checkpoint: the first signal ends it where it is; under mpiexec, where one rank stopping alone
    would leave the others waiting for it in a collective, at the end, every rank together."""
    cfg, say = run.cfg, run.say
    doing = [w for w, on in (("validating", run.val_loader), ("HellaSwag", run.hellaswag_total),
                             ("sampling", run.decoder)) if on]
    what = (" and ".join(doing) + " the model once" if doing else
            "nothing else asked for either (-v 0, -s 0): only the model is loaded")
    unwritten = " (-o is not written)" if cfg.output_dir else ""
    say(f"-x {cfg.max_steps}: no training{unwritten}; {what}")
    try:
        with signals.at_once() if run.dist.world_size == 1 else contextlib.nullcontext():
            if run.val_loader:
                say_val_loss(run, None)
            if run.hellaswag_total:
                say_hellaswag(run, None)
            if run.decoder and run.rank0:
                say(sample_text(run.model, run.decoder, cfg))
        if run.dist.world_size > 1 and signal_received(signals, run.dist):   # all ranks, at the end
            raise Stopped(signals.exit_code)
    except Stopped:                           # a training run's stop line and exit code
        if run.rank0:
            print(f"stopped by {signals.name} after {run.start_step} steps: -x {cfg.max_steps} "
                  f"trains nothing, nothing to save", file=sys.stderr, flush=True)
        raise
