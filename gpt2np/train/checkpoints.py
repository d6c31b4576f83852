"""A run's checkpoints in -o: written (model_STEP.bin, state_STEP_RANK.bin, then DONE_STEP), rotated
(-nk/-nm) and resumed from (-y 1). Which checkpoint to resume, and whose run a folder holds:
gpt2np.train.rundir."""
import contextlib
import os
import sys

from gpt2np.errors import WriteError
from gpt2np.fileio import sync_folder
from gpt2np.formats.checkpoint import (
    checkpoint_files,
    checkpoints_to_delete,
    delete_checkpoint,
    done_path,
    load_model,
    load_state,
    model_path,
    remove_done_marker,
    save_model,
    save_state,
    state_path,
)
from gpt2np.train.state import LoopState, Run


def write_checkpoint(run: Run, state: LoopState, step):
    """The checkpoint of `step` with llm.c's line, then -nk's rotation."""
    run.say(f"Writing checkpoint at step {step}", flush=True)             # llm.c's line
    save_checkpoint(run.cfg.output_dir, step, run.model, run.train_loader, run.dist,
                    nonfinite_skipped=state.nonfinite_skipped, outliers=state.guard.state())
    state.last_saved = step
    rotate_checkpoints(run.cfg, step, run.dist, run.say)


def save_checkpoint(out_dir, step, model, train_loader, dist, nonfinite_skipped=0, outliers=None):
    """model_STEP.bin (rank 0), state_STEP_RANK.bin (each rank), then DONE_STEP once all are
    written. outliers: OutlierGuard.state() (-sl/-sg), kept so that a resumed run skips what the
    whole run would. A DONE_STEP already there (a resume from before `step` writes it again) is
    removed first, before any rank writes a file of step: a crash part-way through must leave an
    incomplete checkpoint, not the old marker over a mix of old and new files."""
    # bf16: llm.c's v5 model file; the fp32 master weights (-w 1) go into the state
    dtype = "bf16" if model.low_precision else "fp32"
    if dist.rank == 0:
        remove_done_marker(out_dir, step)
    dist.barrier()                # no rank writes its state while the old DONE_STEP may be there
    if dist.rank == 0:
        save_model(model_path(out_dir, step), model.cfg, model.params_host(), dtype=dtype)
    shard = dist.shard(model.num_parameters)
    info = {"step": step, "train_loader": train_loader.state(),
            "world_size": dist.world_size, "rank": dist.rank, "zero_stage": dist.zero_stage,
            "shard": list(shard), "nonfinite_skipped": nonfinite_skipped}
    if outliers is not None:
        info["outliers"] = outliers
    m, v = model.optimizer_state_host(shard)
    master = model.master_weights_host(shard)
    save_state(state_path(out_dir, step, dist.rank), info, m, v, master,
               loader=train_loader.llmc_state())
    dist.barrier()
    if dist.rank == 0:
        write_done_marker(out_dir, step)


def write_done_marker(out_dir, step):
    """DONE_STEP, synced with its folder: as durable as the files it vouches for. A write failing is
    WriteError (exit 1, one line), as the model's and the state's, and leaves no marker behind."""
    try:
        with open(done_path(out_dir, step), "w"):
            pass
        sync_folder(out_dir)
    except OSError as e:
        with contextlib.suppress(OSError):   # a marker made but not synced: not left vouching
            os.unlink(done_path(out_dir, step))
        raise WriteError(done_path(out_dir, step), e) from e


def rotate_checkpoints(cfg, step, dist, say):
    """-nk N (-nm M): the checkpoint of `step` is complete (DONE written); delete the older
    checkpoints in -o but the N newest (this one among them) and the major ones, oldest first, each
    with llm.c's line (checkpoint.checkpoints_to_delete). On the -n grid that is llm.c's rule, step
    - N*n unless major; unlike llm.c it counts the checkpoints that exist, so one a stop by signal
    wrote, or the last step's off the grid, is rotated away in its turn (llm.c's arithmetic never
    names it, and names steps never written: those get no line here). Rank 0 lists -o and tells the
    others (one broadcast, after its DONE_step: no rank deletes before the new checkpoint is whole,
    and all delete the same steps); every rank removes its own files of them
    (checkpoint.delete_checkpoint). A file that cannot be removed, or -o unlisted, is a note, not
    the end of the run."""
    keep = cfg.checkpoints_keep
    if keep <= 0:
        return
    old = []
    if dist.rank == 0:
        try:
            old = checkpoints_to_delete(step, checkpoint_files(cfg.output_dir), keep,
                                        cfg.major_checkpoint_every,
                                        reach=keep * cfg.checkpoint_every)
        except OSError as e:
            print(f"note: -nk {keep}: could not list {cfg.output_dir} for checkpoints to delete: "
                  f"{e}", file=sys.stderr, flush=True)
    for gone in dist.broadcast_object(old):
        say(f"Deleting checkpoint at step {gone}", flush=True)
        try:
            delete_checkpoint(cfg.output_dir, gone, dist.rank)
        except OSError as e:
            print(f"note: -nk {keep}: could not delete the checkpoint of step {gone}: {e}",
                  file=sys.stderr, flush=True)


def resume_checkpoint(out_dir, step, model, train_loader, dist):
    """Load the checkpoint of `step` in -o (rundir.prepare_run_dir chose it and checked it is this
    run's, whole, and written by as many processes with the same ZeRO stage); returns its state's
    info."""
    saved_cfg, params = load_model(model_path(out_dir, step), keep_bf16=model.low_precision)
    if saved_cfg != model.cfg:
        raise ValueError(f"{model_path(out_dir, step)}: model config {saved_cfg} differs from -e's "
                         f"{model.cfg}")
    model.load_params(params)
    path = state_path(out_dir, step, dist.rank)
    lo, hi = dist.shard(model.num_parameters)
    info, m, v, master = load_state(path, num_params=hi - lo, with_master=True)   # this rank's
    if info.get("rank", dist.rank) != dist.rank or info.get("step", step) != step:
        raise ValueError(f"{path}: written by rank {info.get('rank')} at step {info.get('step')}, "
                         f"read by rank {dist.rank} for step {step}")
    if model.low_precision and (master is not None) != model.has_master_weights and dist.rank == 0:
        # llm.c warns for the first and refuses the second; the second is a fresh -w 1 start from
        # these weights
        print(f"note: {path} " + ("holds fp32 master weights; -w 0 continues from the bf16 weights "
                                  "without them" if master is not None else
                                  "has no fp32 master weights (a -w 0 run's); -w 1 makes them from "
                                  "the bf16 weights, as at the start of a run"))
    if not model.has_master_weights:
        master = None                         # an fp32 or -w 0 run keeps no master weights
    model.load_optimizer_state(m, v, master)
    saved_loader = info.get("train_loader")   # gpt2np's footer: the loader's settings and epoch
    if saved_loader:
        train_loader.check_settings(saved_loader, source=path)
    epoch = (saved_loader or {}).get("epoch", 0)
    train_loader.load_llmc_state(info["loader"], epoch=epoch, source=path)
    if saved_loader is None and dist.rank == 0:     # llm.c's own state file: no past losses
        print(f"note: {path} is llm.c's: the outlier window of -sl/-sg (and the z-scores) fills "
              f"again")
    if dist.rank == 0:
        print(f"resuming from step {step} ({model_path(out_dir, step)})")
    return info
