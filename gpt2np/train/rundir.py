"""Run folders (-o): whose run a folder holds, which of its checkpoints are complete, tidying up.

A run records its identity in `-o/run.json` when it starts: the model it started from (config and a
hash of the initial weights, or "random init"), its data files (paths and sizes) and the settings a
resume must keep (B, T, total batch, processes, ZeRO stage, seed, shuffling, the lr schedule). -x is
not part of it, so a finished run can be extended.

    fresh run, -o holds checkpoints   refused in one line; --overwrite moves the old run's files
                                      into -o/previous-YYYYmmdd-HHMMSS/ first (nothing is deleted)
    -y 1                              resumes the same run only, from its latest complete
                                      checkpoint: DONE_N present, model_N and every state_N_RANK
                                      readable with the sizes their headers give; newer incomplete
                                      ones are skipped, noted
    start                             temporary files a killed writer left behind (atomic_write's
                                      .NAME.PID.HEX.tmp, writer no longer running) are removed

prepare_run_dir does all of it; under MPI every rank decides (reading only, so all ranks raise
together) and rank 0 alone changes the folder, between two barriers.
"""
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time

import numpy as np

from gpt2np.config import TrainConfig
from gpt2np.dist import shard_bounds, stop_on_problem
from gpt2np.fileio import atomic_write, file_in_the_way
from gpt2np.formats.checkpoint import (
    CheckpointError,
    checkpoint_files,
    checkpoint_name,
    done_path,
    model_path,
    read_model_header,
    read_state_header,
    state_path,
)
from gpt2np.tensors import num_parameters

RUN_FILE = "run.json"
RUN_FORMAT = "gpt2np run 1"
LOG_FILE = "main.log"
# atomic_write's temporary files: .NAME.PID.HEX.tmp (gpt2np.fileio)
TEMP_FILE = re.compile(r"\.(.+)\.(\d+)\.[0-9a-f]{8}\.tmp")
# a main.log line: s:STEP trl:... (the loss of step STEP, 0-based), s:STEP tel:... (val loss after
# STEP steps) or s:STEP eval:... (HellaSwag after STEP steps)
LOG_LINE = re.compile(r"s:(\d+) (trl|tel|eval):")
FLAGS = ({f.name: f.metadata["flag"] for f in dataclasses.fields(TrainConfig)}
         | {"processes": "processes"})


class RunDirError(ValueError):
    """-o cannot be used as asked (another run's checkpoints, a file, ...); the message says what to
    do."""


# ---- identity ------------------------------------------------------------------------------------
def run_identity(model_cfg, init_params, train_files, val_files, settings: dict) -> dict:
    """What makes checkpoints this run's: run.json's content, less the time it was written.

    init_params: the initial weights as loaded from -e (hashed), or None for a random init (the seed
    is among the settings). settings: {TrainConfig field name or 'processes': value}.
    """
    model = {"config": dataclasses.asdict(model_cfg)}
    if init_params is None:
        model["init"] = "random"
    else:
        weights = np.ascontiguousarray(init_params, dtype=np.float32)
        model["sha256"] = hashlib.sha256(weights.data).hexdigest()
    data = {"train": _file_list(train_files), "val": _file_list(val_files) if val_files else None}
    return {"format": RUN_FORMAT, "model": model, "data": data, "settings": settings}


def _file_list(paths):
    return [[os.path.abspath(p), os.path.getsize(p)] for p in paths]


def identity_differences(saved: dict, current: dict) -> list:
    """What differs between a recorded run and this one, in words ([] = the same run)."""
    out = []
    if saved.get("model") != current["model"]:
        out.append("the model -e (config or initial weights)")
    saved_data = saved.get("data") or {}
    if saved_data.get("train") != current["data"]["train"]:
        out.append("the train data -i (files or their sizes)")
    val = current["data"]["val"]
    if saved_data.get("val") and val and saved_data["val"] != val:
        out.append("the val data -j (files or their sizes)")
    theirs, ours = saved.get("settings") or {}, current["settings"]
    order = list(FLAGS)                          # train.py's flag order, then any others
    for key in sorted(theirs.keys() | ours.keys(),
                      key=lambda k: (order.index(k) if k in order else len(order), k)):
        if theirs.get(key) != ours.get(key):
            out.append(f"{FLAGS.get(key, key)} {_shown(theirs.get(key), key)} there, "
                       f"{_shown(ours.get(key), key)} here")
    return out


def _shown(value, key=None):
    if value is None and key == "precision":   # bf16's only: fp32 and tf32 runs share checkpoints
        return "fp32 or tf32"
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def read_run_file(out_dir):
    """The recorded identity in out_dir, or None when there is none."""
    path = os.path.join(out_dir, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: unreadable ({e}); move it away to use this folder") from None
    if not isinstance(saved, dict) or saved.get("format") != RUN_FORMAT:
        raise RunDirError(f"{path}: not a gpt2np run file (format {RUN_FORMAT!r}); move it away to "
                          f"use this folder")
    data = saved.get("data")
    if not (isinstance(saved.get("model"), dict) and isinstance(data, dict)
            and isinstance(saved.get("settings"), dict) and isinstance(data.get("train"), list)
            and isinstance(data.get("val"), (list, type(None)))):
        raise RunDirError(f"{path}: damaged (model, data and settings must be objects, data's "
                          f"train and val lists); move it away to use this folder")
    return saved


def write_run_file(out_dir, identity):
    with atomic_write(os.path.join(out_dir, RUN_FILE), "w") as f:
        json.dump(dict(identity, written=time.strftime("%Y-%m-%d %H:%M:%S")), f, indent=1)
        f.write("\n")


# ---- checkpoints ---------------------------------------------------------------------------------
def checkpoint_problem(out_dir, step):
    """Why the checkpoint of `step` is incomplete or damaged, or None if it is whole: DONE_ marker,
    model file and the state file of every process that wrote it (as many as rank 0's state says)
    readable, right sizes."""
    if not os.path.isfile(done_path(out_dir, step)):
        return (f"no {os.path.basename(done_path(out_dir, step))}: it was still being written when "
                f"its run stopped")
    try:
        cfg, _ = read_model_header(model_path(out_dir, step))
        info, _ = _state_header(state_path(out_dir, step, 0), cfg, 0)
        for rank in range(1, int(info.get("world_size", 1))):
            _state_header(state_path(out_dir, step, rank), cfg, rank)
    except CheckpointError as e:
        return str(e)
    return None


def _state_header(path, cfg, rank):
    """read_state_header(path), its size checked too where only the model can say it: an llm.c state
    file (no gpt2np footer) holds m and v for all the model's parameters, or for this rank's ZeRO-1
    shard of them (its header does not say which): a file that fits neither is truncated or corrupt.
    """
    info, n = read_state_header(path)
    if "n" in info:                         # gpt2np's footer says it (and its size was checked)
        return info, n
    world = int(info.get("world_size", 1))
    if not 0 <= rank < world:
        raise CheckpointError(f"{path}: its header says rank {info.get('rank')} of {world} "
                              f"processes: damaged")
    total = num_parameters(cfg)
    lo, hi = shard_bounds(total, world)[rank]
    sizes = dict.fromkeys([total, hi - lo])           # whole, or this rank's ZeRO-1 shard
    if n is not None:                       # from the file's size: the model's (or a shard's)
        if n not in sizes:
            raise CheckpointError(f"{path}: optimizer state for {n} parameters, the model has "
                                  f"{total}: truncated or corrupt")
        return info, n
    problems = []
    for size in sizes:
        try:
            return read_state_header(path, num_params=size)
        except CheckpointError as e:
            problems.append(str(e))
    raise CheckpointError(problems[0])


def latest_complete_checkpoint(out_dir):
    """(step, notes): the newest complete checkpoint (None if none) and one note per newer one
    skipped."""
    notes = []
    for step in sorted(checkpoint_files(out_dir), reverse=True):
        problem = checkpoint_problem(out_dir, step)
        if problem is None:
            return step, notes
        notes.append(f"note: skipping the checkpoint of step {step} in {out_dir}: {problem}")
    return None, notes


# ---- tidying -------------------------------------------------------------------------------------
def remove_stale_temp_files(out_dir):
    """Remove atomic_write temporary files in out_dir whose writing process is gone; returns their
    names."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        m = TEMP_FILE.fullmatch(name)
        if m and not _running(int(m.group(2))):
            try:
                os.unlink(os.path.join(out_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _running(pid):
    """Whether a process with this id runs on this machine (not us: at start we are writing
    nothing)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process
        return True
    except OverflowError:
        return False
    return True


def run_files(out_dir):
    """Names of the files a run writes into out_dir: run.json, main.log and its checkpoint files."""
    return sorted(name for name in os.listdir(out_dir)
                  if name in (RUN_FILE, LOG_FILE) or checkpoint_name(name))


def move_aside(out_dir):
    """Move the run files of out_dir into a new subfolder previous-YYYYmmdd-HHMMSS[-K]; returns its
    path."""
    names = run_files(out_dir)
    if not names:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, k = os.path.join(out_dir, f"previous-{stamp}"), 1
    while os.path.exists(target):
        k += 1
        target = os.path.join(out_dir, f"previous-{stamp}-{k}")
    os.mkdir(target)
    for name in names:
        shutil.move(os.path.join(out_dir, name), os.path.join(target, name))
    return target


def trim_log(out_dir, step, rewritten=("tel", "eval")):
    """Drop main.log's lines after `step` (written by an attempt that stopped before its next
    checkpoint) and its lines of `step` the resumed run writes again (its trl; the `rewritten`
    kinds: the evaluations it runs again at `step`, as llm.c's loop), so a resumed run's log reads
    as one uninterrupted run's."""
    path = os.path.join(out_dir, LOG_FILE)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if not (m := LOG_LINE.match(line)) or int(m.group(1)) < step
            or (int(m.group(1)) == step and m.group(2) != "trl" and m.group(2) not in rewritten)]
    if kept != lines:
        with atomic_write(path, "w") as f:
            f.writelines(kept)


# ---- all of it -----------------------------------------------------------------------------------
def check_output_dir(out_dir):
    """-o must be a folder (or not exist yet)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise RunDirError(f"-o {out_dir} is a file, not a folder: give the folder for main.log and "
                          f"the checkpoints (it is made if missing)")
    blocking = file_in_the_way(out_dir)
    if blocking is not None:
        raise RunDirError(f"-o {out_dir}: {blocking} is a file, so the folder cannot be made there")


@dataclasses.dataclass
class RunDirPlan:
    """What check_run_dir decided: the step to resume from (0 = from scratch), whether what an
    earlier attempt left (main.log, incomplete checkpoint files) is moved aside, and whether -o had
    a run.json."""
    step: int
    log_aside: bool
    recorded: bool


def prepare_run_dir(out_dir, identity, dist, *, resume, overwrite, total_steps, read_only=False,
                    evaluated=lambda step: ("tel", "eval")):
    """Check -o against this run and claim it; returns the step to resume from (0 = start from
    scratch).

    Raises RunDirError (one line) when a fresh run would mix with checkpoints already there, or -y 1
    finds another run's; with -y 1 the step returned is the latest complete checkpoint's, and that
    checkpoint's state files were written by as many processes with the same ZeRO stage. read_only
    (-x 0 -y 1: evaluate the latest checkpoint): no file is written, and a checkpoint past
    total_steps is fine. evaluated(step): the main.log kinds ("tel", "eval") the run writes at
    `step` (trim_log keeps the others' lines of the resumed step).
    """
    try:
        plan = check_run_dir(out_dir, identity, dist, resume=resume, overwrite=overwrite,
                             total_steps=total_steps, read_only=read_only)
        problem = None
    except (ValueError, OSError) as e:      # RunDirError, a damaged state header
        plan, problem = None, e
    stop_on_problem(dist, problem)
    if read_only:
        return plan.step
    dist.barrier()                   # every rank has decided before rank 0 changes the folder
    if dist.rank == 0:
        tidy_run_dir(out_dir, identity, plan, overwrite, evaluated)
    dist.barrier()
    return plan.step


def check_run_dir(out_dir, identity, dist, *, resume, overwrite, total_steps,
                  read_only) -> RunDirPlan:
    """prepare_run_dir's decision, made by every rank alike (rank 0 also makes the folder and locks
    it)."""
    say = _note if dist.rank == 0 else (lambda msg: None)
    check_output_dir(out_dir)
    if resume and overwrite:
        raise RunDirError("-y 1 resumes the run in -o, --overwrite starts a new one there: give "
                          "one of them")
    if dist.rank == 0:
        _claim_folder(out_dir, read_only, say)
    saved = read_run_file(out_dir)
    differences = identity_differences(saved, identity) if saved else None
    steps = sorted(checkpoint_files(out_dir), reverse=True)
    recorded = saved is not None
    if not resume:
        return RunDirPlan(0, _check_fresh_start(out_dir, steps, differences, overwrite), recorded)
    found, notes = latest_complete_checkpoint(out_dir)
    for line in notes:
        say(line)
    if found is None:
        log_aside = _check_start_over(out_dir, steps, differences, read_only, say)
        return RunDirPlan(0, log_aside, recorded)
    _check_processes(state_path(out_dir, found, 0), dist)
    if differences:
        raise RunDirError(f"{out_dir} holds another run's checkpoints, not this one's: "
                          f"{'; '.join(differences)}. Resume with that run's -e, data and "
                          f"settings, or use another -o")
    if not recorded:
        say(f"note: {out_dir} has no {RUN_FILE} (checkpoints from an older gpt2np, or copied): "
            f"resuming without checking they are this run's")
    if found > total_steps and not read_only:
        raise RunDirError(f"{out_dir}: its latest checkpoint is at step {found}, past -x "
                          f"{total_steps}: give -x {found} or more to resume it")
    return RunDirPlan(found, False, recorded)


def _claim_folder(out_dir, read_only, say):
    """Rank 0: make -o and lock it for the run (exclusive), or for -x 0 -y 1, which only reads,
    share a lock."""
    if not read_only:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            why = e.strerror or e
            raise RunDirError(f"-o {out_dir}: the folder cannot be made ({why})") from None
        _lock(out_dir)         # before reading the folder: what is checked stays so until the end
    elif os.path.isdir(out_dir) and not _lock(out_dir, shared=True):
        # a shared lock keeps a run from starting there while it reads; beside a run that writes
        # there now it goes on, saying what that run's checkpoint rotation may do
        say(f"note: {out_dir} is in use by another gpt2np run: its checkpoint rotation (-nk) may "
            f"remove the checkpoint chosen here before it is read")


def _nonempty_log(out_dir) -> bool:
    log = os.path.join(out_dir, LOG_FILE)
    return os.path.isfile(log) and os.path.getsize(log) > 0


def _check_fresh_start(out_dir, steps, differences, overwrite) -> bool:
    """A run without -y 1: refused where -o holds checkpoints (without --overwrite); returns whether
    this run's main.log, there without a checkpoint (a -n 0 run's whole record, or an attempt
    stopped before its first), is moved aside rather than started over."""
    if overwrite:
        return False
    if steps:
        if differences == [] and latest_complete_checkpoint(out_dir)[0] is None:
            raise RunDirError(f"{out_dir} holds only incomplete checkpoint files of this run (step "
                              f"{steps[0]}: {checkpoint_problem(out_dir, steps[0])}): -y 1 starts "
                              f"the run over there, --overwrite moves them into a subfolder first")
        if differences == []:
            raise RunDirError(f"{out_dir} holds checkpoints of this run (up to step {steps[0]}): "
                              f"resume it with -y 1, or start over with --overwrite (moves its "
                              f"files into a subfolder)")
        raise RunDirError(f"{out_dir} holds another run's checkpoints (up to step {steps[0]}): use "
                          f"another -o, or --overwrite to move them into a subfolder")
    _refuse_another_runs_log(out_dir, differences)
    return _nonempty_log(out_dir)


def _check_start_over(out_dir, steps, differences, read_only, say) -> bool:
    """-y 1 where -o has no complete checkpoint: a start from scratch; returns whether what that
    attempt left (main.log, incomplete checkpoint files) is moved aside."""
    if steps and differences:
        raise RunDirError(f"{out_dir} holds another run's checkpoints (none of them complete): use "
                          f"another -o, or start a new run there with --overwrite (moves them "
                          f"into a subfolder)")
    if not steps and not read_only:       # starting from scratch would truncate its main.log
        _refuse_another_runs_log(out_dir, differences)
    say(f"note: nothing to resume in {out_dir}; " + ("evaluating -e's model" if read_only
                                                       else "starting from scratch"))
    return bool(steps) or _nonempty_log(out_dir)


def tidy_run_dir(out_dir, identity, plan: RunDirPlan, overwrite, evaluated):
    """Rank 0, once every rank has decided: remove stale temporary files, move an old run or attempt
    aside, record run.json and trim main.log to the resumed step."""
    removed = remove_stale_temp_files(out_dir)
    if removed:
        _note(f"note: removed {len(removed)} temporary file(s) a stopped run left in {out_dir}")
    if overwrite and (target := move_aside(out_dir)):
        _note(f"note: moved the previous run's files in {out_dir} to {target}")
    elif plan.log_aside and (target := move_aside(out_dir)):
        _note(f"note: {out_dir} holds no complete checkpoint to resume: moved what an earlier "
              f"attempt left there (main.log, incomplete checkpoint files) to {target}, starting "
              f"over")
    if plan.recorded or not plan.step:    # an unchecked run's: once its checkpoint has loaded
        write_run_file(out_dir, identity)
        if plan.step:
            trim_log(out_dir, plan.step, evaluated(plan.step))


# realpath of an -o -> the open folder this process holds a lock on (flock), so that a second run or
# a resume there stops instead of mixing its files with this run's
_held = {}


def _lock(out_dir, shared=False):
    """Hold a flock on the folder out_dir itself until release_run_dirs(): exclusive (a run that
    writes there), RunDirError when another process holds any; or shared (a run that only reads
    there), False when a writer holds one. Where the file system has no such locks, nothing is held.
    True when held (or there are no locks)."""
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            if shared:
                return False
            raise RunDirError(f"{out_dir} is in use by another gpt2np run (it holds a lock on the "
                              f"folder): wait for it to end, or use another -o") from None
        return True                      # no locks here (some network file systems): unguarded
    _held[os.path.realpath(out_dir)] = fd
    return True


def release_run_dirs():
    """Let go of the -o folders this process locked (the run has ended)."""
    while _held:
        os.close(_held.popitem()[1])


def claim_run(out_dir, identity, dist, step, evaluated=lambda step: ("tel", "eval")):
    """After a resume's checkpoint of `step` has loaded: where the folder had no run.json, write it
    and trim main.log (prepare_run_dir leaves both undone, so a resume that fails to load, say with
    another -e, leaves the folder as it was)."""
    if dist.rank == 0 and read_run_file(out_dir) is None:
        write_run_file(out_dir, identity)
        trim_log(out_dir, step, evaluated(step))


def _refuse_another_runs_log(out_dir, differences):
    """A run with no checkpoints in -o would start main.log over: refuse when the log there is
    another run's."""
    log = os.path.join(out_dir, LOG_FILE)
    if differences and os.path.isfile(log) and os.path.getsize(log) > 0:
        raise RunDirError(f"{out_dir} holds another run's main.log (no checkpoints; "
                          f"{'; '.join(differences)}): use another -o, or --overwrite to move it "
                          f"into a subfolder")


def _check_processes(path, dist):
    """A resume needs the number of processes and the ZeRO stage the checkpoint's state files were
    written with."""
    info, _ = read_state_header(path)
    if info.get("world_size", 1) != dist.world_size:
        raise RunDirError(f"{path}: written by {info['world_size']} processes; "
                          f"resume needs the same number, got {dist.world_size}")
    # llm.c's own files do not say their stage
    if "zero_stage" in info and info["zero_stage"] != dist.zero_stage:
        raise RunDirError(f"{path}: written with ZeRO stage {info.get('zero_stage', 0)} (-z); "
                          f"resume needs the same, got -z {dist.zero_stage}")


def _note(msg):
    print(msg, file=sys.stderr, flush=True)

