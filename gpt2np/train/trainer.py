"""The training loop behind train.py: llm.c's loop (validate, sample, checkpoint, step) on any backend.

train(cfg) takes a TrainConfig (train.py maps llm.c's flags onto it); it prints llm.c's header and one line per
step, writes a log and checkpoints to -o, and resumes bit-identically with -y 1.

How a run ends other than by finishing: -o holding another run's checkpoints, -y 1 on another run's, ->
RunDirError before anything is written (gpt2np.train.rundir); a NaN/Inf loss or grad norm -> a RuntimeError naming
the step, the update not applied and no checkpoint written after it (or the step skipped, --skip-nonfinite);
-sl/-sg skip the update of an outlier step (gpt2np.outlier) and go on, as llm.c does;
SIGINT/SIGTERM -> the step finishes, a checkpoint is written to -o, exit 130/143 (gpt2np.train.interrupts).
-x 0 trains nothing: it validates and samples the model once and writes nothing.
"""
import contextlib
import math
import os
import signal
import sys
import time
import warnings

from gpt2np import ranges
from gpt2np.backends import cuda_problem, get_backend, gpu_present, resolve_attention, resolve_name, resolve_precision
from gpt2np.config import GPT2Config, TrainConfig, descriptor
from gpt2np.datasets.data import DataLoader
from gpt2np.datasets.starter import Decoder, resolve_data, resolve_model
from gpt2np.dist import check_same_run, make_process_group, run_fingerprint, stop_on_problem, stop_together
from gpt2np.errors import BAD_INPUT_ERRORS, BadInput, WriteError, is_int, one_line
from gpt2np.fileio import append_line, atomic_write, sync_folder
from gpt2np.formats.checkpoint import (
    CheckpointError,
    checkpoint_files,
    checkpoints_to_delete,
    delete_checkpoint,
    done_path,
    load_model,
    load_state,
    model_path,
    read_state_header,
    remove_done_marker,
    save_model,
    save_state,
    state_path,
)
from gpt2np.generate import generate
from gpt2np.model import GPT2
from gpt2np.outlier import OutlierGuard, exceeded
from gpt2np.profiling.gpu_specs import flops_per_token, mfu, peak_flops
from gpt2np.profiling.profiler import Profiler, device_label, device_roofline, report_text, write_outputs
from gpt2np.rng import LlmcCoins
from gpt2np.tensors import num_parameters
from gpt2np.train.evaluate import eval_loss
from gpt2np.train.interrupts import Stopped, StopSignals
from gpt2np.train.rundir import (
    LOG_LINE,
    RunDirError,
    check_output_dir,
    claim_run,
    latest_complete_checkpoint,
    prepare_run_dir,
    read_run_file,
    release_run_dirs,
    run_identity,
)
from gpt2np.train.schedule import learning_rate
from gpt2np.train_step import AdamW, NonFiniteError, PendingStep, train_step

PRECISION_TEXT = {"fp32": "fp32 (exact fp32 matmuls)", "tf32": "tf32 (matmuls on TF32 tensor cores)",
                  "bf16": "bf16 (bf16 storage, fp32 math and AdamW state)"}
# the header's master weights row (llm.c's use_master_weights): bf16 with -w 1, with -w 0; fp32 and tf32 runs
# (their parameters are fp32: -w has no effect, as in llm.c) show it only when -w 0 was given
MASTER_WEIGHTS_TEXT = {1: "enabled (fp32 copy, AdamW updates it)",
                       0: "disabled (-w 0: AdamW updates the bf16 weights)",
                       "fp32": "-w 0 has no effect: the parameters are fp32"}


def header_table(rows, title=None):
    """llm.c's header tables: keys padded to 21 characters, values to 50. title=False: the rows and the closing
    line only (they follow the table before, as llm.c prints its later tables); else the opening lines first, with
    the key column headed `title` (llm.c's first table: "Parameter")."""
    width = max([21] + [len(k) for k, _ in rows])
    line = "+" + "-" * (width + 2) + "+" + "-" * 52 + "+"
    out = [] if title is False else [line, f"| {title or 'Parameter':<{width}} | {'Value':<50} |", line]
    out += [f"| {k:<{width}} | {str(v):<50} |" for k, v in rows]
    out.append(line)
    return "\n".join(out)


class Logger:
    """llm.c's main.log lines (s:STEP trl:LOSS ... / s:STEP tel:LOSS), appended, in -o.

    A line that cannot be written (disk full) stops the run with WriteError naming main.log: a run whose log
    silently ends is worse than one that stops. The log keeps whole lines only (fileio.append_line)."""

    def __init__(self, out_dir, rank, resume):
        self.path = os.path.join(out_dir, "main.log") if out_dir and rank == 0 else None
        self._resumed = resume            # the first line of a resumed run may go before its step's kept lines
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
        """A resumed run's val line of step s goes before the HellaSwag lines of step s that main.log kept (the
        resumed run does not run HellaSwag at s again): llm.c's order, a step's val loss before its HellaSwag.
        Returns whether it did (main.log rewritten atomically)."""
        m = LOG_LINE.match(line)
        if not m or m.group(2) != "tel" or not os.path.isfile(self.path):
            return False
        with open(self.path) as f:
            lines = f.readlines()
        at = len(lines)
        while at and (k := LOG_LINE.match(lines[at - 1])) and k.group(1) == m.group(1) and k.group(2) == "eval":
            at -= 1
        if at == len(lines):
            return False
        with atomic_write(self.path, "w") as f:
            f.writelines(lines[:at] + [line + "\n"] + lines[at:])
        return True


LONG_VALIDATION = 100     # batches from which a validation shows its progress (-m -1 on a big val set)


def evaluate(model, loader, max_batches, show_progress=True):
    """Mean loss over max_batches validation batches from the loader's start (-1: llm.c's count, all the tokens'
    worth; more than there are wraps around to the first again, as llm.c's -m does); a long one shows a progress bar
    on stderr (plain lines when stderr is not a terminal)."""
    with ranges.range("validation"):
        return eval_loss(model, loader, max_batches, quiet_below=LONG_VALIDATION if show_progress else math.inf)[0]


def zero_stage(cfg: TrainConfig, stage, processes, num_params):
    """(the ZeRO stage to run, a note or None): llm.c's set_zero_configs turns stage 1 off when the parameters do not
    divide evenly over the processes; a run resumed from a checkpoint sharded so (gpt2np before 2026-11-24) keeps
    its shards."""
    if stage != 1 or num_params % processes == 0:
        return stage, None
    if cfg.resume and resumes_zero1(cfg.output_dir):
        return 1, (f"note: -z 1: the model's parameters do not divide evenly over {processes} processes (llm.c "
                   f"would turn ZeRO off); the run in {cfg.output_dir} was sharded so before 2026-11-24 and resumes so")
    return 0, (f"note: -z 1: the model's {num_params} parameters do not divide evenly over {processes} processes: "
               f"ZeRO is off (stage 0), as in llm.c")


def resumes_zero1(out_dir) -> bool:
    """Whether -o's latest complete checkpoint was written with ZeRO stage 1 (so -y 1 must keep its shards)."""
    try:
        step = latest_complete_checkpoint(out_dir)[0] if out_dir and os.path.isdir(out_dir) else None
        return step is not None and read_state_header(state_path(out_dir, step, 0))[0].get("zero_stage") == 1
    except CheckpointError:
        return False


def gpu_memory_line(backend) -> str:
    """-lg's line, indented under the step line as llm.c's: the device's memory in use and its total (what the
    runtime can tell: the CPU emulator knows no device memory)."""
    total = getattr(backend.rt, "total_memory", None)
    free = backend.free_memory()
    if total is None or free is None:
        return "                  memory: not known (the CUDA emulator has no device memory)"
    total = total()
    used = total - free
    return (f"                  memory: {100 * used / total:.1f}% | {used / 2**30:.2f} GiB used of "
            f"{total / 2**30:.2f} GiB")


def throughput_text(backend, flops_per_token, tok_s, processes, device_name) -> str:
    """The step line's throughput: on a GPU llm.c's MFU, one process's tokens (tok_s / processes, all of them
    together) against one GPU's peak; on the CPU the GFLOP/s of all processes."""
    if backend.name == "cuda":
        util = mfu(flops_per_token, tok_s / processes, device_name, backend.precision)
        return f"{100 * util:.1f}% MFU" if util is not None else "MFU n/a"
    return f"{flops_per_token * tok_s / 1e9:.1f} GFLOP/s"


def run_model(cfg: TrainConfig):
    """-y 1 without -e: run.json's model block of the run in -o (config, and its initial weights' hash or random init),
    or None where -o holds no run.json (-e's default then, as before). A run with no complete checkpoint to take the
    weights from is one line: without -e there is nothing to start it from."""
    saved = read_run_file(cfg.output_dir) if cfg.output_dir and os.path.isdir(cfg.output_dir) else None
    if not saved or not isinstance(saved.get("model"), dict) or "config" not in saved["model"]:
        return None
    try:
        config = saved["model"]["config"]
        GPT2Config(**config)
        if not all(is_int(v) for v in config.values()):   # 6.0 layers would fail deep in the model
            raise ValueError(f"sizes must be integers, got {config}")
    except (TypeError, ValueError) as e:                 # a hand-edited or damaged run.json
        raise BadInput(f"-y 1 without -e: {os.path.join(cfg.output_dir, 'run.json')}: its model config is not a "
                       f"GPT-2 config ({one_line(e)}); give the run's -e") from None
    if latest_complete_checkpoint(cfg.output_dir)[0] is None:
        raise BadInput(f"-y 1 without -e: {cfg.output_dir} has no complete checkpoint to take the run's weights "
                       f"from; give the run's -e")
    return saved["model"]


def load_hellaswag(cfg: TrainConfig, model_cfg, dist, say=print):
    """--hellaswag (or -h 1): this rank's share of the rendered examples and the total count, or (None, 0).
    Data that cannot be had stops the run for --hellaswag; for -h 1 it is a note and no evaluation, as llm.c's
    -h 1 skips HellaSwag when its file is missing. The ranks decide that together (one collective): HellaSwag's
    scoring is a collective too, so either every rank evaluates or none does."""
    if cfg.hellaswag_interval <= 0:
        return None, 0
    flag = "-h 1" if cfg.hellaswag_eval else "--hellaswag"
    if model_cfg.vocab_size < 50257:
        raise ValueError(f"{flag}: the model's vocab_size is {model_cfg.vocab_size}; HellaSwag is tokenized with "
                         f"GPT-2's 50257 tokens")
    from gpt2np.datasets import hellaswag
    examples, problem = None, None
    try:
        _, examples = hellaswag.load(cfg.hellaswag_data)
    except (OSError, ValueError) as e:              # no file, an offline download, an unreadable file
        if (cfg.hellaswag_data and isinstance(e, (FileNotFoundError, IsADirectoryError))    # the file itself
                and (not os.path.exists(cfg.hellaswag_data) or os.path.isdir(cfg.hellaswag_data))):
            what = "no such file" if isinstance(e, FileNotFoundError) else "a folder, not a HellaSwag .jsonl file"
            e = BadInput(f"--hellaswag-data {cfg.hellaswag_data}: {what}")
        if not cfg.hellaswag_eval:
            raise e from None
        problem = one_line(e)
    if not cfg.hellaswag_eval:
        return examples[dist.rank::dist.world_size], len(examples)
    if problem is not None:
        where = f"rank {dist.rank} of {dist.world_size}: " if dist.world_size > 1 else ""
        print(f"note: {where}-h 1: no HellaSwag data ({problem})")
    if dist.average(0.0 if problem else 1.0) < 1.0:  # a rank without the data: none evaluates
        say("note: -h 1: skipping HellaSwag's evaluation, as llm.c does without its data (fetch it once with "
            "`gpt2np eval hellaswag`, or give --hellaswag-data PATH)")
        return None, 0
    return examples[dist.rank::dist.world_size], len(examples)


def prefetch_hellaswag(cfg: TrainConfig):
    """Rank 0, alone, before the others start: the HellaSwag file into the download cache, so that the ranks do not
    all download it at once (they read the cached copy in load_hellaswag). A failure is load_hellaswag's to report."""
    if cfg.hellaswag_interval > 0 and cfg.hellaswag_data is None:
        from gpt2np.datasets.cache import cached
        from gpt2np.datasets.hellaswag import VAL_FILE
        try:
            cached(VAL_FILE)
        except (OSError, ValueError):
            pass


def evaluate_hellaswag(model, examples, total, dist):
    """acc_norm over every rank's examples (llm.c's number), each rank scoring its share."""
    from gpt2np.datasets import hellaswag
    with ranges.range("hellaswag"):
        correct = hellaswag.score(model, examples).correct_norm if examples else 0
    return round(dist.average(float(correct)) * dist.world_size), total


def stop_if_bad(dist, bad: bool, message: str):
    """Bad input every rank checks alike (a flag against the model): a ValueError(message) where `bad`, rank 0
    alone saying it when every rank finds it (dist.stop_on_problem)."""
    stop_on_problem(dist, ValueError(message) if bad else None)


def train(cfg: TrainConfig, dist=None, model_given=True):
    """Train as cfg says; returns the model. SIGINT/SIGTERM are caught for the whole run (see run_training).
    model_given False (no -e on the command line): a -y 1 resumes the model of the run in -o, as llm.c's -y 1
    takes it from the checkpoint whatever -e says."""
    with StopSignals() as signals, warnings.catch_warnings():
        # a diverging run overflows inside NumPy a step before the NaN guard stops it: its one line says enough
        warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) encountered", RuntimeWarning)
        try:
            return run_training(cfg, dist, signals, model_given)
        except MemoryError as e:        # CuPy's OutOfMemoryError is one; the up-front check should have caught it
            raise RuntimeError(f"out of memory ({' '.join(str(e).split()) or 'MemoryError'}): the model's "
                               f"parameters, gradients and AdamW moments (16 bytes a parameter in fp32) and the "
                               f"activations of -b x -t must fit; use a smaller -e, or a smaller -b (or -t) and -d "
                               f"to keep the tokens per step") from e
        finally:
            release_run_dirs()            # the -o lock prepare_run_dir took, held for the whole run


def run_training(cfg: TrainConfig, dist, signals: StopSignals, model_given=True):
    dist = dist or make_process_group(cfg.device, cfg.zero_stage if cfg.zero_stage <= 1 else 0, cfg.dist_timeout)
    rank0 = dist.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    if cfg.zero_stage > 1:                      # llm.c's set_zero_configs: stages 2 and 3 run as 0
        say(f"note: -z {cfg.zero_stage}: ZeRO stages 2 and 3 are not supported (nor in llm.c): running stage 0")
    for flag, given, actual in (("-pn", cfg.num_processes, dist.world_size), ("-pr", cfg.process_rank, dist.rank)):
        if given is not None and given != actual:       # llm.c's -pi mpi takes MPI's values the same way
            print(f"note: rank {dist.rank} of {dist.world_size}: {flag} {given} differs from what mpiexec started; "
                  f"using mpiexec's {actual}")
    ranges.enable(cfg.nvtx)
    backend_name = resolve_name(cfg.device)
    if cfg.device == "auto" and backend_name == "numpy" and gpu_present():
        say(f"note: --device auto: the GPU is not usable, training on the CPU: {cuda_problem()}")
    # the precision asked for (--precision, --tf32) or the device's default, whichever device auto picked
    precision, note = resolve_precision(backend_name, cfg.requested_precision)
    if note:
        say(f"note: {note}")
    asked_math = cfg.cpu_math or "fast"
    backend = get_backend(backend_name, precision=precision,
                          **({"math": asked_math} if backend_name == "numpy" else {}))
    cpu_math = getattr(backend, "math", None)          # None: not the numpy backend
    if backend_name == "numpy" and cpu_math not in (None, asked_math):
        say(f"note: --cpu-math {asked_math}: the C loops did not build here (no working C compiler?), running the "
            f"NumPy reference code")
    if cfg.lr_schedule == "constant" and cfg.final_lr_frac != 1.0:
        say(f"note: -q {cfg.final_lr_frac:g}: -k constant keeps the learning rate at -l; -q is not used")
    if backend_name == "numpy" and cfg.log_gpu_every > 0:
        say(f"note: -lg {cfg.log_gpu_every}: this run is on the CPU, there is no GPU to log")
    if backend_name != "numpy" and cfg.cpu_math:
        say(f"note: --cpu-math {cfg.cpu_math} is for the CPU; this run is on {backend_name}, where --precision sets "
            f"the math")
    requested_attention = cfg.attention
    cfg = cfg.with_device_defaults(backend_name).validate()     # the device defaults against the other flags
    if cfg.output_dir:                            # early, before the model loads; every rank alike: one line
        try:
            check_output_dir(cfg.output_dir)
            problem = None
        except RunDirError as e:
            problem = e
        stop_on_problem(dist, problem)
    bf16 = backend.precision == "bf16"            # under mpiexec too: bf16 gradients averaged (gpt2np.dist)

    def resolve_inputs():                         # the model and the data files (rank 0 fetches what is missing)
        recorded = run_model(cfg) if cfg.resume and not model_given else None
        if recorded:                              # -y 1 without -e: the run's model, weights from the checkpoint
            model = GPT2Config(**recorded["config"]), None, f"the run in {cfg.output_dir}"
        else:
            model = resolve_model(cfg.model, keep_bf16=bf16)
        return recorded, model, resolve_data(cfg.train_data, cfg.val_data)

    # rank 0 first, alone (it fetches and prepares what is missing), then the others; bad input rank 0 finds stops
    # every rank, in one line from rank 0 (the others would each find it too)
    if dist.rank == 0:
        try:
            inputs, problem = resolve_inputs(), None
            if dist.world_size > 1:
                prefetch_hellaswag(cfg)
        except BAD_INPUT_ERRORS as e:
            problem = e
        stop_on_problem(dist, problem)
    else:
        stop_on_problem(dist, None)
        inputs = resolve_inputs()
    recorded, (model_cfg, params, model_desc), (train_pattern, val_pattern) = inputs
    model_name = model_desc if recorded else f"-e {cfg.model}"        # in messages: what the model is
    # the header's weight init method: -e as llm.c prints it, but the offline default's stand-in says what it is
    init_method = cfg.model if params is not None or recorded or descriptor(cfg.model) else model_desc
    stage, zero_note = zero_stage(cfg, dist.zero_stage, dist.world_size, num_parameters(model_cfg))
    if zero_note:
        say(zero_note)
    dist.zero_stage = stage
    B, T = cfg.batch_size, cfg.seq_len
    stop_if_bad(dist, T > model_cfg.max_seq_len, f"-t {T} is longer than the model's max_seq_len "
                f"{model_cfg.max_seq_len}")
    stop_if_bad(dist, backend.name == "cuda" and model_cfg.channels % 4 != 0, f"{model_name}: channels "
                f"{model_cfg.channels} is not a multiple of 4, which the CUDA kernels need (kernels/encoder.cu loads 4 "
                f"channels at once); train this model on the CPU (--device cpu)")
    attention, note = resolve_attention(backend, model_cfg.channels // model_cfg.num_heads, requested_attention)
    if note:
        say(f"note: {note}")
    tokens_per_micro = B * T * dist.world_size
    total_batch = cfg.total_batch_size if cfg.total_batch_size and cfg.total_batch_size > 0 else tokens_per_micro
    stop_if_bad(dist, total_batch % tokens_per_micro != 0, f"-d {total_batch} with -b {B} -t {T} on "
                f"{dist.world_size} process(es): the total batch size must be a multiple of B*T*processes = "
                f"{tokens_per_micro}")
    accum = total_batch // tokens_per_micro

    # -a 1 is llm.c's: the val shards (the train shards where there are none) in file order, read again from their
    # first batch every step, so every step trains on the same accum micro-batches
    overfit = bool(cfg.overfit_single_batch)
    try:                                          # every rank reads the shards: a bad one stops all, in one line
        train_loader = DataLoader(val_pattern if overfit and val_pattern else train_pattern, B, T, dist.rank,
                                  dist.world_size, shuffle=bool(cfg.shuffle) and not overfit,
                                  vocab_size=model_cfg.vocab_size)
        val_loader = DataLoader(val_pattern, B, T, dist.rank, dist.world_size,
                                vocab_size=model_cfg.vocab_size) if val_pattern and cfg.val_every > 0 else None
        problem = None
    except BAD_INPUT_ERRORS as e:
        problem = e
    stop_on_problem(dist, problem)
    one_epoch = train_loader.num_tokens // total_batch         # llm.c's train_num_batches for -x -1 (can be 0)
    total_steps = cfg.max_steps if cfg.max_steps >= 0 else one_epoch
    if cfg.max_steps < 0 and one_epoch == 0:
        say(f"note: -x -1: the train data's {train_loader.num_tokens} tokens are fewer than one step's "
            f"{total_batch}: no step to train (as llm.c's)")
    evaluate_only = total_steps == 0          # -x 0: validate and sample the model once; -o is not written

    if backend.name == "cuda":        # one line saying what fits, before CuPy runs out of memory mid-allocation
        lo, hi = dist.shard(num_parameters(model_cfg))
        backend.check_memory_fits(model_cfg, B, T, optimizer_elements=hi - lo, model_name=model_name,
                                  reserved=dist.reserved_device_memory(), sharers=dist.gpu_sharers,
                                  attention=attention, master_weights=bool(cfg.master_weights),
                                  recompute=cfg.recompute)
    model = GPT2(model_cfg, backend, B, T, seed=cfg.init_seed if params is None else None, attention=attention,
                 fuse=bool(cfg.fuse), gelu_fusion=cfg.gelu_fusion, recompute=cfg.recompute,
                 master_weights=bool(cfg.master_weights))
    model.rounding_seed = cfg.seed            # bf16: the stochastic rounding of the parameters (AdamW)
    if params is not None:
        model.load_params(params)
    # under mpiexec: every rank must run this same job (settings, model, data), else all stop with one line
    check_same_run(dist, lambda: run_fingerprint(cfg, backend, model_cfg, params, train_loader, val_loader))
    decoder = Decoder(train_pattern) if cfg.sample_every > 0 else None

    hellaswag_examples, hellaswag_total = load_hellaswag(cfg, model_cfg, dist, say)

    def hellaswag_eval(step):
        correct, total = evaluate_hellaswag(model, hellaswag_examples, hellaswag_total, dist)
        say(f"HellaSwag: {correct}/{total} = {correct / total:.6f}")
        if step is not None:
            logger.log(f"s:{step} eval:{correct / total:.4f}")

    start_step, skipped = 0, 0                # skipped: non-finite steps skipped so far (--skip-nonfinite)
    # the window of recent losses and norms: every step line's z-scores (llm.c's), and with -sl/-sg the outliers
    # skipped (one step late, see gpt2np.outlier)
    guard = OutlierGuard(cfg.skip_update_lossz, cfg.skip_update_gradz)
    if cfg.resume and not cfg.output_dir:
        raise ValueError("-y 1 (resume) needs -o, the folder the checkpoints are in")
    if cfg.output_dir and (cfg.resume or not evaluate_only):
        settings = {"batch_size": B, "seq_len": T, "total_batch_size": total_batch, "processes": dist.world_size,
                    "zero_stage": dist.zero_stage, "seed": cfg.seed, "shuffle": cfg.shuffle,
                    "overfit_single_batch": cfg.overfit_single_batch, "learning_rate": cfg.learning_rate,
                    "warmup_steps": cfg.warmup_steps, "final_lr_frac": cfg.final_lr_frac,
                    "lr_schedule": cfg.lr_schedule, "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip,
                    "beta1": cfg.beta1, "beta2": cfg.beta2, "eps": cfg.eps}
        if bf16:                                  # bf16 checkpoints hold master weights an fp32 run cannot use
            settings["precision"] = "bf16"
        if params is None and (not recorded or recorded.get("init") == "random"):    # a random init's seed
            settings["init_seed"] = cfg.init_seed
        identity = run_identity(model_cfg, params, train_loader.files, val_loader.files if val_loader else None,
                                settings)
        if recorded:
            identity["model"] = recorded          # what the run started from, as run.json says
        def evaluated(step):                      # main.log's kinds the loop writes at `step` (the resumed one)
            last = step == total_steps
            return ((("tel",) if val_loader and (step % cfg.val_every == 0 or last) else ())
                    + (("eval",) if hellaswag_total and (cfg.hellaswag_due(step) or last) else ()))

        start_step = prepare_run_dir(cfg.output_dir, identity, dist, resume=bool(cfg.resume),
                                     overwrite=cfg.overwrite, total_steps=total_steps, read_only=evaluate_only,
                                     evaluated=evaluated)
    if start_step:
        info = resume(cfg.output_dir, start_step, model, train_loader, dist)
        if not evaluate_only:
            claim_run(cfg.output_dir, identity, dist, start_step, evaluated)
        skipped = int(info.get("nonfinite_skipped", 0))
        if "outliers" in info:
            guard.load_state(info["outliers"])
        if start_step == total_steps:             # llm.c: the last step's evaluations, then the end
            say(f"{cfg.output_dir}: the run is at step {start_step} already, -x {total_steps}: no step to train "
                f"(give a larger -x to train on); the last step's evaluations run again")
    logger = Logger(None if evaluate_only else cfg.output_dir, dist.rank, resume=start_step > 0)

    device_name = device_label(backend)
    fpt = flops_per_token(model.num_parameters, model_cfg.num_layers, model_cfg.channels, T)
    # llm.c's tables and lines (train_gpt2.cu's main), then gpt2np's own settings
    train_shown = val_pattern if overfit and val_pattern else train_pattern                  # -a 1: llm.c's too
    say(header_table([
        ("train data pattern", train_shown), ("val data pattern", val_pattern or "-"),
        ("output log dir", cfg.output_dir or "NULL"), ("checkpoint_every", cfg.checkpoint_every),
        ("resume", cfg.resume), ("micro batch size B", B), ("sequence length T", T),
        ("total batch size", total_batch), ("LR scheduler", cfg.lr_schedule),
        ("learning rate (LR)", f"{cfg.learning_rate:e}"), ("warmup iterations", cfg.warmup_steps),
        ("final LR fraction", f"{cfg.final_lr_frac:e}"), ("weight decay", f"{cfg.weight_decay:e}"),
        ("skip update lossz", f"{cfg.skip_update_lossz:f}"), ("skip update gradz", f"{cfg.skip_update_gradz:f}"),
        ("max_steps", cfg.max_steps), ("val_loss_every", cfg.val_every), ("val_max_steps", cfg.val_max_batches),
        ("sample_every", cfg.sample_every), ("genT", cfg.gen_tokens),
        ("overfit_single_batch", cfg.overfit_single_batch),
        ("use_master_weights", "enabled" if cfg.master_weights else "disabled"),
        ("gelu_fusion", model.gelu_fusion), ("recompute", model.recompute)]))
    peak = peak_flops(device_name, backend.precision) if backend.name == "cuda" else None
    say(header_table([("device", "cuda (the CPU emulator)" if backend_name == "emu"
                       else f"{backend.name} ({device_name})"),
                      ("peak TFlops", f"{peak / 1e12:.1f}" if peak else "n/a"),
                      ("precision", backend.precision.upper())], title=False))
    say(header_table([("weight init method", "intermediate checkpoint" if start_step else init_method),
                      ("max_sequence_length T", model_cfg.max_seq_len), ("vocab_size V", model_cfg.vocab_size),
                      ("padded_vocab_size Vp", model_cfg.padded_vocab_size), ("num_layers L", model_cfg.num_layers),
                      ("num_heads NH", model_cfg.num_heads), ("channels C", model_cfg.channels),
                      ("num_parameters", model.num_parameters)], title=False))
    say(header_table([("train_num_batches", total_steps),
                      ("val_num_batches", val_loader.eval_batches(cfg.val_max_batches) if val_loader else 0)],
                     title=False))
    say(header_table([("run hellaswag", "yes" if hellaswag_total else "no")], title=False))
    say(header_table([("num_processes", dist.world_size), ("zero_stage", dist.zero_stage)], title=False))
    param_bytes = model.num_parameters * model.params.dtype.itemsize
    say(f"num_parameters: {model.num_parameters} => bytes: {param_bytes}")
    say(f"allocated {param_bytes // 2 ** 20} MiB for model parameters")
    say(f"batch_size B={B} * seq_len T={T} * num_processes={dist.world_size} and total_batch_size={total_batch}")
    say(f"=> setting grad_accum_steps={accum}")
    if T < model_cfg.max_seq_len and backend_name == "cuda":    # llm.c's CUDA trainer's warning (its CPU one has none)
        say(f"WARNING: -t {T} is shorter than the model's max_seq_len {model_cfg.max_seq_len}: the wpe rows from "
            f"{T} on get no gradient (GPT-2 trains at -t 1024, GPT-3 at -t 2048)")
    say(header_table([                                          # gpt2np's settings beside llm.c's
        ("model", model_desc), ("grad clip", cfg.grad_clip), ("seed", cfg.seed), ("init seed", cfg.init_seed),
        ("shuffle", int(train_loader.shuffle)), ("precision", PRECISION_TEXT.get(backend.precision,
                                                                                 backend.precision))]
        + ([("cpu math", cpu_math)] if cpu_math else [])
        + ([("master weights", MASTER_WEIGHTS_TEXT[cfg.master_weights if bf16 else "fp32"])]
           if bf16 or not cfg.master_weights else [])
        + [("attention", attention), ("fuse", int(model.fuse))], title="gpt2np"))
    say(f"train dataset num_batches: {train_loader.num_batches}")
    if val_loader:
        say(f"val dataset num_batches: {val_loader.num_batches}")
    if evaluate_only:
        doing = [w for w, on in (("validating", val_loader), ("HellaSwag", hellaswag_total), ("sampling", decoder))
                 if on]
        say(f"-x {cfg.max_steps}: no training" + (" (-o is not written)" if cfg.output_dir else "") + "; "
            + (" and ".join(doing) + " the model once" if doing else
               "nothing else asked for either (-v 0, -s 0): only the model is loaded"))
        try:
            # nothing to checkpoint: the first signal ends it where it is; under mpiexec, where one rank stopping
            # alone would leave the others waiting for it in a collective, at the end, every rank together
            with signals.at_once() if dist.world_size == 1 else contextlib.nullcontext():
                if val_loader:
                    say(f"val loss "
                        f"{dist.average(evaluate(model, val_loader, cfg.val_max_batches, show_progress=rank0)):.6f}")
                if hellaswag_total:
                    hellaswag_eval(None)
                if decoder and rank0:
                    say(sample_text(model, decoder, cfg))
            if dist.world_size > 1 and signal_received(signals, dist):      # every rank alike, at the end
                raise Stopped(signals.exit_code)
        except Stopped:                           # a training run's stop line and exit code (stop_on_signal's)
            if rank0:
                print(f"stopped by {signals.name} after {start_step} steps: -x {cfg.max_steps} trains nothing, "
                      f"nothing to save", file=sys.stderr, flush=True)
            raise
        return model
    if start_step < total_steps:                  # (a finished run resumed: the note above says there is none)
        say(f"training for {total_steps} steps")

    adamw = AdamW(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip)
    step_times = []
    profiler = None
    last_saved = start_step or None               # the step of this run's newest checkpoint in -o

    def checkpoint(step):
        nonlocal last_saved
        say(f"Writing checkpoint at step {step}", flush=True)             # llm.c's line
        save_checkpoint(cfg.output_dir, step, model, train_loader, dist, nonfinite_skipped=skipped,
                        outliers=guard.state())
        last_saved = step
        rotate_checkpoints(cfg, step, dist, say)

    # A device step (CUDA) returns before the device has run it (gpt2np.train_step.PendingStep): its line is
    # printed when the next step has been queued (one step late), or before anything else the loop does
    # (validation, sampling, checkpoints, a stop), so a non-finite step still stops the run before a checkpoint.
    pending = None                                # (step, lr, result, t0, limits, span): the step whose line is not out
    last_report = None                            # when the previous line's result arrived
    tok_s_ema = 0.0                               # llm.c's smoothed tokens/s (from the run's second line on)

    def report(entry):
        nonlocal skipped, last_report, tok_s_ema
        step_, lr_, result, t0, limits, span = entry
        try:
            if isinstance(result, NonFiniteError):
                raise result
            loss, norm = result
            applied = True
            outlier = exceeded(loss, norm, limits) if limits else None   # what the step was skipped for
            z_loss, z_norm = guard.zscores(step_, loss, norm, lag=1)       # the line's: llm.c's own numbers
            z_skip = guard.zscores(step_, loss, norm) if outlier else None   # the decision's window (one step late)
            guard.observe(step_, loss, norm)
            guard.skipped += outlier is not None
        except NonFiniteError as e:               # the update was not applied: the model is still step's
            if skipped >= cfg.skip_nonfinite:
                kept = (f"the last checkpoint, step {last_saved}, is untouched" if last_saved
                        else "no checkpoint was written" if cfg.output_dir else "no -o, no checkpoint")
                more = f" after skipping {skipped} (--skip-nonfinite {cfg.skip_nonfinite})" if skipped else ""
                stop_together(dist)               # every rank sees the same averaged loss and global norm
                raise RuntimeError(f"{e}; stopping{more} ({kept})") from None
            skipped += 1
            loss, norm, applied = e.loss, e.grad_norm, False
        now = time.perf_counter()
        if span is not None:                      # a device step: its time on the device's own clock
            dt = backend.elapsed_ms(*span) / 1e3
        else:
            dt = now - max(t0, last_report or t0)     # queued steps: from the previous result to this one
        last_report = now
        step_times.append(dt)
        tok_s = total_batch / dt
        # the line's tok/s is llm.c's: the first line's own rate, then an EMA (0.95) of the rates, bias-corrected
        k = len(step_times) - 1
        tok_s_ema = 0.95 * tok_s_ema + 0.05 * tok_s if k else 0.0
        tok_s_shown = tok_s_ema / (1.0 - 0.95 ** k) if k else tok_s
        perf = throughput_text(backend, fpt, tok_s, dist.world_size, device_name)
        if applied:
            # llm.c's line: the z-scores over the window (nan while it fills, the first 128 steps)
            line = (f"step {step_ + 1:4d}/{total_steps} | loss {loss:.6f} ({z_loss:+.2f}z)| norm {norm:.4f} "
                    f"({z_norm:+.2f}z)| lr {lr_:.2e} | {dt * 1e3:.2f} ms | {perf} | {tok_s_shown:.0f} tok/s")
            if outlier:                           # llm.c's line, then the step's; main.log keeps the loss (llm.c)
                flag, z, limit = (("-sl", z_skip[0], cfg.skip_update_lossz) if outlier == "loss" else
                                  ("-sg", z_skip[1], cfg.skip_update_gradz))
                say(f"skipping update due to {'loss' if outlier == 'loss' else 'grad'} z-score of {z:f}")
                line += f" | skipped: {outlier} z-score {z:.2f} > {flag} {limit:g} ({guard.skipped} outliers skipped)"
            say(line, flush=True)
            if cfg.log_gpu_every > 0 and (step_ + 1) % cfg.log_gpu_every == 0 and backend.name == "cuda":
                say(gpu_memory_line(backend), flush=True)
            logger.log(f"s:{step_} trl:{loss:.4f} lr:{lr_:.6f} norm:{norm:.2f}")      # llm.c's logger.h formats
        else:                                     # not in main.log: the step changed nothing
            say(f"step {step_ + 1:4d}/{total_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr_:.2e} | skipped: "
                f"not finite ({skipped} of --skip-nonfinite {cfg.skip_nonfinite})", flush=True)

    for step in range(start_step, total_steps + 1):
        last = step == total_steps
        resumed_here = step == start_step and start_step > 0
        stopping = signal_received(signals, dist)
        busy = (last or stopping or val_loader and step % cfg.val_every == 0 or hellaswag_total
                and cfg.hellaswag_due(step) or decoder and step > 0 and step % cfg.sample_every == 0
                or cfg.output_dir and cfg.checkpoint_every > 0 and step > 0 and step % cfg.checkpoint_every == 0)
        if pending and busy:                      # the queued step's numbers first
            entry, pending = pending, None
            report(entry)
        if stopping:                              # between two steps: stop here, with a checkpoint
            trained_here = step > start_step
            stop_on_signal(signals, step, checkpoint if cfg.output_dir and trained_here else None, cfg.output_dir,
                           rank0)
        # at the resumed step, as llm.c: the evaluations run (again: main.log was trimmed of them), not the
        # checkpoint (a stop by signal writes its checkpoint before that step's evaluations)
        if val_loader and (step % cfg.val_every == 0 or last):
            val_loss = dist.average(evaluate(model, val_loader, cfg.val_max_batches, show_progress=rank0))
            say(f"val loss {val_loss:.6f}")
            logger.log(f"s:{step} tel:{val_loss:.4f}")
        if hellaswag_total and (cfg.hellaswag_due(step) or last):
            hellaswag_eval(step)
        if decoder and rank0 and step > 0 and (step % cfg.sample_every == 0 or last):
            say(sample_text(model, decoder, cfg))
        if (cfg.output_dir and cfg.checkpoint_every > 0 and step > 0 and (step % cfg.checkpoint_every == 0 or last)
                and not resumed_here):
            checkpoint(step)
        if last:
            break
        lr = learning_rate(step, cfg.learning_rate, total_steps, cfg.warmup_steps, cfg.final_lr_frac,
                           cfg.lr_schedule)
        if cfg.profile_steps and step == start_step + 1:       # step start_step is the warm-up
            profiler = Profiler(model.backend, model=model).__enter__()
        # the outlier limits from the steps up to step - 2: all a device step has read back by now
        limits = guard.limits(step) if guard.active else None
        if overfit:
            train_loader.reset()
        t0 = time.perf_counter()
        # A device step is timed by two events around its queueing: the first fires when the device gets to it
        # (after the previous step's work), the second after its last command, so their distance is the step's
        # time on the device also while the host runs ahead (host clocks between results would then show the
        # bursts in which results arrive, not the steps: 0.4 ms once on an H100)
        span = None
        if backend.name == "cuda":
            span = (backend.event(), backend.event())
            span[0].record()
        try:
            result = train_step(model, train_loader.next_batch, step=step, lr=lr, accum_steps=accum, adamw=adamw,
                                dist=dist, cuda_graphs=bool(cfg.cuda_graphs), limits=limits)
        except NonFiniteError as e:               # the host step raises at once
            result = e
        if isinstance(result, PendingStep) and span is not None:
            span[1].record()
        else:
            span = None
        entry = (step, lr, result, t0, limits, span)
        if isinstance(result, PendingStep):       # the device step: report the previous one while this one runs
            entry, pending = pending, entry
        if entry is not None:
            report(entry)
        if profiler and (step == start_step + cfg.profile_steps or step == total_steps - 1):
            if pending:                           # its line before the report
                entry, pending = pending, None
                report(entry)
            profiler.__exit__(None, None, None)
            if rank0:
                report_profile(profiler, backend, model_cfg, cfg)
            profiler = None
    if step_times:
        timed = step_times[1:] or step_times
        say(f"total average iteration time: {1e3 * sum(timed) / len(timed):f} ms")
    if guard.active:
        say(f"updates skipped as outliers (-sl {cfg.skip_update_lossz:g} -sg {cfg.skip_update_gradz:g}): "
            f"{guard.skipped}")
    return model


def report_profile(profiler, backend, model_cfg, cfg):
    """The built-in profiler's report of the profiled steps, and its files in -o (or ./profile)."""
    roof = device_roofline(backend)
    print(report_text(profiler, roof), end="")       # profiling.views.DEFAULT_VIEWS of the last profiled step
    paths = write_outputs(profiler, os.path.join(cfg.output_dir or ".", "profile"), roof,
                          title=f"{cfg.model}, B={cfg.batch_size}, T={cfg.seq_len}, {device_label(backend)}")
    print("profile written: " + ", ".join(paths.values()))


def signal_received(signals: StopSignals, dist) -> bool:
    """Whether any process got SIGINT/SIGTERM: under mpiexec all ranks must stop at the same step (a scalar
    all-reduce per step; a rank that got none stops as if by SIGTERM)."""
    if dist.world_size == 1:
        return signals.signum is not None
    anyone = dist.average(0.0 if signals.signum is None else 1.0) > 0
    if anyone and signals.signum is None:
        signals.signum = signal.SIGTERM
    return anyone


def stop_on_signal(signals: StopSignals, step, checkpoint, out_dir, rank0):
    """Write the checkpoint of `step` (checkpoint(step); None when this process trained nothing new or there is
    no -o), say so in one line and exit 128 + the signal's number."""
    if checkpoint:
        checkpoint(step)
        what = f"checkpoint of step {step} written to {out_dir} (resume with -y 1)"
    elif not out_dir:
        what = "no -o, so nothing was saved"
    elif step:
        what = f"the checkpoint of step {step} in {out_dir} is the latest (resume with -y 1)"
    else:
        what = "nothing trained yet, nothing to save"
    if rank0:
        print(f"stopped by {signals.name} after {step} steps: {what}", file=sys.stderr, flush=True)
    raise Stopped(signals.exit_code)


def sample_text(model, decoder, cfg: TrainConfig) -> str:
    """llm.c's training sample: from the EOT token, -g - 1 new tokens (llm.c's genT counts the EOT), one coin a
    token from llm.c's xorshift state, set to --seed (llm.c's 1337) for every sample."""
    tokens = generate(model, [decoder.eot_token], cfg.gen_tokens - 1, LlmcCoins(cfg.seed), cfg.temperature,
                      cfg.top_k)
    return "generating:\n---\n" + decoder.decode(tokens[1:]) + "\n---"


def save_checkpoint(out_dir, step, model, train_loader, dist, nonfinite_skipped=0, outliers=None):
    """model_STEP.bin (rank 0), state_STEP_RANK.bin (each rank), then DONE_STEP once all are written.
    outliers: OutlierGuard.state() (-sl/-sg), kept so that a resumed run skips what the whole run would.
    A DONE_STEP already there (a resume from before `step` writes it again) is removed first, before any rank
    writes a file of step: a crash part-way through must leave an incomplete checkpoint, not the old marker over
    a mix of old and new files."""
    bf16 = model.low_precision                   # llm.c's v5 file; the fp32 master weights (-w 1) go into the state
    if dist.rank == 0:
        remove_done_marker(out_dir, step)
    dist.barrier()                               # no rank writes its state while the old DONE_STEP may be there
    if dist.rank == 0:
        save_model(model_path(out_dir, step), model.cfg, model.params_host(), dtype="bf16" if bf16 else "fp32")
    info = {"step": step, "train_loader": train_loader.state(),
            "world_size": dist.world_size, "rank": dist.rank, "zero_stage": dist.zero_stage,
            "shard": list(dist.shard(model.num_parameters)), "nonfinite_skipped": nonfinite_skipped}
    if outliers is not None:
        info["outliers"] = outliers
    m, v = model.optimizer_state_host(dist.shard(model.num_parameters))
    master = model.master_weights_host(dist.shard(model.num_parameters))
    save_state(state_path(out_dir, step, dist.rank), info, m, v, master, loader=train_loader.llmc_state())
    dist.barrier()
    if dist.rank == 0:
        try:
            with open(done_path(out_dir, step), "w"):
                pass
            sync_folder(out_dir)                 # the marker as durable as the files it vouches for
        except OSError as e:                     # a write failing, as the model's and the state's: exit 1, one line
            with contextlib.suppress(OSError):   # a marker made but not synced: not left vouching
                os.unlink(done_path(out_dir, step))
            raise WriteError(done_path(out_dir, step), e) from e


def rotate_checkpoints(cfg: TrainConfig, step, dist, say):
    """-nk N (-nm M): the checkpoint of `step` is complete (DONE written); delete the older checkpoints in -o but
    the N newest (this one among them) and the major ones, oldest first, each with llm.c's line
    (checkpoint.checkpoints_to_delete). On the -n grid that is llm.c's rule, step - N*n unless major; unlike llm.c
    it counts the checkpoints that exist, so one a stop by signal wrote, or the last step's off the grid, is
    rotated away in its turn (llm.c's arithmetic never names it, and names steps never written: those get no line
    here). Rank 0 lists -o and tells the others (one broadcast, after its DONE_step: no rank deletes before the new
    checkpoint is whole, and all delete the same steps); every rank removes its own files of them
    (checkpoint.delete_checkpoint). A file that cannot be removed, or -o unlisted, is a note, not the end of the
    run."""
    keep = cfg.checkpoints_keep
    if keep <= 0:
        return
    old = []
    if dist.rank == 0:
        try:
            old = checkpoints_to_delete(step, checkpoint_files(cfg.output_dir), keep, cfg.major_checkpoint_every,
                                        reach=keep * cfg.checkpoint_every)
        except OSError as e:
            print(f"note: -nk {keep}: could not list {cfg.output_dir} for checkpoints to delete: {e}",
                  file=sys.stderr, flush=True)
    for gone in dist.broadcast_object(old):
        say(f"Deleting checkpoint at step {gone}", flush=True)
        try:
            delete_checkpoint(cfg.output_dir, gone, dist.rank)
        except OSError as e:
            print(f"note: -nk {keep}: could not delete the checkpoint of step {gone}: {e}", file=sys.stderr,
                  flush=True)


def resume(out_dir, step, model, train_loader, dist):
    """Load the checkpoint of `step` in -o (rundir.prepare_run_dir chose it and checked it is this run's, whole,
    and written by as many processes with the same ZeRO stage); returns its state's info."""
    saved_cfg, params = load_model(model_path(out_dir, step), keep_bf16=model.low_precision)
    if saved_cfg != model.cfg:
        raise ValueError(f"{model_path(out_dir, step)}: model config {saved_cfg} differs from -e's {model.cfg}")
    model.load_params(params)
    path = state_path(out_dir, step, dist.rank)
    lo, hi = dist.shard(model.num_parameters)
    info, m, v, master = load_state(path, num_params=hi - lo, with_master=True)       # m: this rank's share
    if info.get("rank", dist.rank) != dist.rank or info.get("step", step) != step:
        raise ValueError(f"{path}: written by rank {info.get('rank')} at step {info.get('step')}, read by rank "
                         f"{dist.rank} for step {step}")
    if model.low_precision and (master is not None) != model.has_master_weights and dist.rank == 0:
        # llm.c warns for the first and refuses the second; the second is a fresh -w 1 start from these weights
        print(f"note: {path} " + ("holds fp32 master weights; -w 0 continues from the bf16 weights without them"
                                  if master is not None else "has no fp32 master weights (a -w 0 run's); -w 1 "
                                  "makes them from the bf16 weights, as at the start of a run"))
    if not model.has_master_weights:
        master = None                         # an fp32 or -w 0 run keeps no master weights
    model.load_optimizer_state(m, v, master)
    saved_loader = info.get("train_loader")
    if "loader" in info:                      # llm.c's layout: its position, shard and sample orders, generator
        if saved_loader:
            train_loader.check_settings(saved_loader, source=path)
        train_loader.load_llmc_state(info["loader"], epoch=(saved_loader or {}).get("epoch", 0), source=path)
    else:                                     # gpt2np's earlier state files: the position, replayed
        train_loader.load_state(saved_loader)
    if saved_loader is None and dist.rank == 0:          # llm.c's own state file: no window of past losses
        print(f"note: {path} is llm.c's: the outlier window of -sl/-sg (and the z-scores) fills again")
    if dist.rank == 0:
        print(f"resuming from step {step} ({model_path(out_dir, step)})")
    return info
