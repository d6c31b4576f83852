"""A training run's setup, in llm.c's order: the process group and backend, the model and data, the
run folder (-o: whose run it is, the checkpoint to resume), then llm.c's header.

setup(cfg, dist, model_given) returns the Run the loop reads and the LoopState it starts from. Bad
input that any rank finds stops every rank, in one line from rank 0 (dist.stop_on_problem).
"""
import os
from dataclasses import dataclass

from gpt2np import ranges
from gpt2np.backends import (
    cuda_problem,
    device_traits,
    get_backend,
    gpu_present,
    resolve_attention,
    resolve_name,
    resolve_precision,
)
from gpt2np.config import GPT2Config, TrainConfig, descriptor
from gpt2np.datasets.data import DataLoader
from gpt2np.datasets.starter import Decoder, resolve_data, resolve_model
from gpt2np.dist import check_same_run, make_process_group, run_fingerprint, stop_on_problem
from gpt2np.errors import BAD_INPUT_ERRORS, BadInput, is_int, one_line
from gpt2np.model import GPT2
from gpt2np.outlier import OutlierGuard
from gpt2np.profiling.gpu_specs import flops_per_token
from gpt2np.profiling.profiler import device_label
from gpt2np.tensors import num_parameters
from gpt2np.train.checkpoints import resume_checkpoint
from gpt2np.train.evaluate import load_hellaswag, prefetch_hellaswag
from gpt2np.train.log import Logger, print_header
from gpt2np.train.rundir import (
    RunDirError,
    check_output_dir,
    claim_run,
    latest_complete_checkpoint,
    prepare_run_dir,
    read_run_file,
    run_identity,
)
from gpt2np.train.state import LoopState, Run


@dataclass
class Inputs:
    """The model and data files a run starts from (rank 0 fetches what is missing)."""
    recorded: dict | None     # -y 1 without -e: run.json's model block of the run in -o
    model_cfg: GPT2Config
    params: object            # -e's weights; None: a random init (or the checkpoint's weights)
    model_desc: str           # what the model is, in words
    train_pattern: str
    val_pattern: str | None


def quiet(*args, **kwargs):
    """What a rank other than 0 prints where rank 0 speaks for all: nothing."""


def setup(cfg: TrainConfig, dist=None, model_given=True) -> tuple[Run, LoopState]:
    """Everything before the first step: notes, backend, model and data, the run folder and the
    checkpoint to resume, the header. model_given False (no -e on the command line): -y 1 resumes
    the run's own model."""
    stage = cfg.zero_stage if cfg.zero_stage <= 1 else 0
    dist = dist or make_process_group(cfg.device, stage, cfg.dist_timeout)
    say = print if dist.rank == 0 else quiet
    note_process_flags(cfg, dist, say)
    ranges.enable(cfg.nvtx)
    requested_attention = cfg.attention
    backend, cfg = make_backend(cfg, say)
    if cfg.output_dir:                    # early, before the model loads; every rank alike
        try:
            check_output_dir(cfg.output_dir)
            problem = None
        except RunDirError as e:
            problem = e
        stop_on_problem(dist, problem)
    inputs = resolve_inputs_together(cfg, dist, model_given, bf16=backend.precision == "bf16")
    dist.zero_stage, zero_note = zero_stage(dist.zero_stage, dist.world_size,
                                            num_parameters(inputs.model_cfg))
    if zero_note:
        say(zero_note)
    attention, total_batch = check_sizes(cfg, dist, backend, inputs, requested_attention, say)
    run = make_run(cfg, dist, backend, inputs, attention, total_batch, say)
    state = LoopState(guard=OutlierGuard(cfg.skip_update_lossz, cfg.skip_update_gradz))
    run.start_step = open_run_dir(run, state, inputs)
    state.last_saved = run.start_step or None
    log_dir = None if run.total_steps == 0 else cfg.output_dir      # -x 0 writes nothing
    run.logger = Logger(log_dir, dist.rank, resume=run.start_step > 0)
    print_header(run)
    return run, state


def make_run(cfg: TrainConfig, dist, backend, inputs: Inputs, attention, total_batch, say) -> Run:
    """The data loaders, the model, the sampler's decoder and HellaSwag's examples: the Run, before
    its folder is opened (start_step 0, no log yet)."""
    overfit = bool(cfg.overfit_single_batch)
    train_loader, val_loader = make_loaders(cfg, dist, inputs, overfit)
    total_steps = count_steps(cfg, train_loader.num_tokens, total_batch, say)
    model = make_model(cfg, dist, backend, inputs, attention)
    # under mpiexec: every rank must run this same job (settings, model, data), else all stop with
    # one line
    check_same_run(dist, lambda: run_fingerprint(cfg, backend, inputs.model_cfg, inputs.params,
                                                 train_loader, val_loader))
    decoder = Decoder(inputs.train_pattern) if cfg.sample_every > 0 else None
    hellaswag_examples, hellaswag_total = load_hellaswag(cfg, inputs.model_cfg, dist, say)
    model_cfg = inputs.model_cfg
    fpt = flops_per_token(model.num_parameters, model_cfg.num_layers, model_cfg.channels,
                          cfg.seq_len)
    return Run(cfg=cfg, dist=dist, backend=backend, model=model, train_loader=train_loader,
               val_loader=val_loader, decoder=decoder, hellaswag_examples=hellaswag_examples,
               hellaswag_total=hellaswag_total, logger=None, start_step=0, total_steps=total_steps,
               total_batch=total_batch,
               accum=total_batch // (cfg.batch_size * cfg.seq_len * dist.world_size),
               overfit=overfit, say=say, device_name=device_label(backend), flops_per_token=fpt,
               model_desc=inputs.model_desc, init_method=init_method(cfg, inputs),
               train_pattern=inputs.train_pattern, val_pattern=inputs.val_pattern,
               attention=attention, cpu_math=getattr(backend, "math", None))


def note_process_flags(cfg: TrainConfig, dist, say):
    """-z 2/3 and -pn/-pr: taken as llm.c takes them, with a note."""
    if cfg.zero_stage > 1:                      # llm.c's set_zero_configs: stages 2 and 3 run as 0
        say(f"note: -z {cfg.zero_stage}: ZeRO stages 2 and 3 are not supported (nor in llm.c): "
            f"running stage 0")
    for flag, given, actual in (("-pn", cfg.num_processes, dist.world_size),
                                ("-pr", cfg.process_rank, dist.rank)):
        if given is not None and given != actual:   # llm.c's -pi mpi takes MPI's values so too
            print(f"note: rank {dist.rank} of {dist.world_size}: {flag} {given} differs from what "
                  f"mpiexec started; using mpiexec's {actual}")


def make_backend(cfg: TrainConfig, say):
    """(backend, cfg with the device's defaults): the device and precision asked for, with a note
    for each flag this device does not use."""
    backend_name = resolve_name(cfg.device)
    traits = device_traits(backend_name)
    if cfg.device == "auto" and not traits.on_gpu and gpu_present():
        say(f"note: --device auto: the GPU is not usable, training on the CPU: {cuda_problem()}")
    # the precision asked for (--precision, --tf32) or the device's default, whichever device auto
    # picked
    precision, note = resolve_precision(backend_name, cfg.requested_precision)
    if note:
        say(f"note: {note}")
    asked_math = cfg.cpu_math or "fast"
    backend = get_backend(backend_name, precision=precision,
                          **({"math": asked_math} if traits.has_cpu_math else {}))
    cpu_math = getattr(backend, "math", None)          # None: not the numpy backend
    if traits.has_cpu_math and cpu_math not in (None, asked_math):
        say(f"note: --cpu-math {asked_math}: the C loops did not build here (no working C "
            f"compiler?), running the NumPy reference code")
    if cfg.lr_schedule == "constant" and cfg.final_lr_frac != 1.0:
        say(f"note: -q {cfg.final_lr_frac:g}: -k constant keeps the learning rate at -l; -q is not "
            f"used")
    if not traits.launches_kernels and cfg.log_gpu_every > 0:
        say(f"note: -lg {cfg.log_gpu_every}: this run is on the CPU, there is no GPU to log")
    if not traits.has_cpu_math and cfg.cpu_math:
        say(f"note: --cpu-math {cfg.cpu_math} is for the CPU; this run is on {backend_name}, where "
            f"--precision sets the math")
    # the device's defaults, then the flags checked against them
    return backend, cfg.with_device_defaults(traits).validate()


def resolve_inputs_together(cfg: TrainConfig, dist, model_given, bf16) -> Inputs:
    """resolve_inputs on rank 0 first, alone (it fetches and prepares what is missing), then on the
    others; bad input rank 0 finds stops every rank, in one line from rank 0 (the others would each
    find it too)."""
    if dist.rank == 0:
        try:
            inputs, problem = resolve_inputs(cfg, model_given, bf16), None
            if dist.world_size > 1:
                prefetch_hellaswag(cfg)
        except BAD_INPUT_ERRORS as e:
            problem = e
        stop_on_problem(dist, problem)
        return inputs
    stop_on_problem(dist, None)
    return resolve_inputs(cfg, model_given, bf16)


def resolve_inputs(cfg: TrainConfig, model_given, bf16) -> Inputs:
    """The model (-e, or with -y 1 and no -e the run's own) and the data files (-i, -j)."""
    recorded = run_model(cfg) if cfg.resume and not model_given else None
    if recorded:                  # -y 1 without -e: the run's model, weights from the checkpoint
        model_cfg, params = GPT2Config(**recorded["config"]), None
        desc = f"the run in {cfg.output_dir}"
    else:
        model_cfg, params, desc = resolve_model(cfg.model, keep_bf16=bf16)
    train_pattern, val_pattern = resolve_data(cfg.train_data, cfg.val_data)
    return Inputs(recorded, model_cfg, params, desc, train_pattern, val_pattern)


def run_model(cfg: TrainConfig):
    """-y 1 without -e: run.json's model block of the run in -o (config, and its initial weights'
    hash or random init), or None where -o holds no run.json (-e's default then). A run with no
    complete checkpoint to take the weights from is one line: without -e there is nothing to start
    it from."""
    out_dir = cfg.output_dir
    saved = read_run_file(out_dir) if out_dir and os.path.isdir(out_dir) else None
    if not saved or not isinstance(saved.get("model"), dict) or "config" not in saved["model"]:
        return None
    try:
        config = saved["model"]["config"]
        GPT2Config(**config)
        if not all(is_int(v) for v in config.values()):   # 6.0 layers would fail deep in the model
            raise ValueError(f"sizes must be integers, got {config}")
    except (TypeError, ValueError) as e:                 # a hand-edited or damaged run.json
        raise BadInput(f"-y 1 without -e: {os.path.join(out_dir, 'run.json')}: its model config is "
                       f"not a GPT-2 config ({one_line(e)}); give the run's -e") from None
    if latest_complete_checkpoint(out_dir)[0] is None:
        raise BadInput(f"-y 1 without -e: {out_dir} has no complete checkpoint to take the run's "
                       f"weights from; give the run's -e")
    return saved["model"]


def model_name(cfg: TrainConfig, inputs: Inputs) -> str:
    """The model as messages name it."""
    return inputs.model_desc if inputs.recorded else f"-e {cfg.model}"


def init_method(cfg: TrainConfig, inputs: Inputs) -> str:
    """The header's weight init method: -e as llm.c prints it, but the offline default's stand-in
    says what it is."""
    if inputs.params is not None or inputs.recorded or descriptor(cfg.model):
        return cfg.model
    return inputs.model_desc


def zero_stage(stage, processes, num_params):
    """(the ZeRO stage to run, a note or None): llm.c's set_zero_configs turns stage 1 off when the
    parameters do not divide evenly over the processes."""
    if stage != 1 or num_params % processes == 0:
        return stage, None
    return 0, (f"note: -z 1: the model's {num_params} parameters do not divide evenly over "
               f"{processes} processes: ZeRO is off (stage 0), as in llm.c")


def stop_if_bad(dist, bad: bool, message: str):
    """Bad input every rank checks alike (a flag against the model): a ValueError(message) where
    `bad`, rank 0 alone saying it when every rank finds it (dist.stop_on_problem)."""
    stop_on_problem(dist, ValueError(message) if bad else None)


def check_sizes(cfg: TrainConfig, dist, backend, inputs: Inputs, requested_attention, say):
    """-t, -d and the attention against the model and the processes; returns (attention, total batch
    size)."""
    model_cfg, B, T = inputs.model_cfg, cfg.batch_size, cfg.seq_len
    stop_if_bad(dist, T > model_cfg.max_seq_len, f"-t {T} is longer than the model's max_seq_len "
                f"{model_cfg.max_seq_len}")
    stop_if_bad(dist, backend.launches_kernels and model_cfg.channels % 4 != 0,
                f"{model_name(cfg, inputs)}: channels {model_cfg.channels} is not a multiple of 4, "
                f"which the CUDA kernels need (kernels/encoder.cu loads 4 channels at once); train "
                f"this model on the CPU (--device cpu)")
    head_size = model_cfg.channels // model_cfg.num_heads
    attention, note = resolve_attention(backend, head_size, requested_attention)
    if note:
        say(f"note: {note}")
    tokens_per_micro = B * T * dist.world_size
    given = cfg.total_batch_size
    total_batch = given if given and given > 0 else tokens_per_micro
    stop_if_bad(dist, total_batch % tokens_per_micro != 0,
                f"-d {total_batch} with -b {B} -t {T} on {dist.world_size} process(es): the total "
                f"batch size must be a multiple of B*T*processes = {tokens_per_micro}")
    return attention, total_batch


def make_loaders(cfg: TrainConfig, dist, inputs: Inputs, overfit):
    """(train loader, val loader or None). -a 1 is llm.c's: the val shards (the train shards where
    there are none) in file order, read again from their first batch every step, so every step
    trains on the same accum micro-batches. Every rank reads the shards: a bad one stops all, in one
    line."""
    B, T, vocab_size = cfg.batch_size, cfg.seq_len, inputs.model_cfg.vocab_size
    train_pattern, val_pattern = inputs.train_pattern, inputs.val_pattern
    try:
        train_loader = DataLoader(val_pattern if overfit and val_pattern else train_pattern, B, T,
                                  dist.rank, dist.world_size,
                                  shuffle=bool(cfg.shuffle) and not overfit, vocab_size=vocab_size)
        val_loader = None
        if val_pattern and cfg.val_every > 0:
            val_loader = DataLoader(val_pattern, B, T, dist.rank, dist.world_size,
                                    vocab_size=vocab_size)
        problem = None
    except BAD_INPUT_ERRORS as e:
        problem = e
    stop_on_problem(dist, problem)
    return train_loader, val_loader


def count_steps(cfg: TrainConfig, train_tokens, total_batch, say) -> int:
    """-x, or for -x -1 llm.c's train_num_batches: one epoch's steps (can be 0)."""
    one_epoch = train_tokens // total_batch
    if cfg.max_steps < 0 and one_epoch == 0:
        say(f"note: -x -1: the train data's {train_tokens} tokens are fewer than one step's "
            f"{total_batch}: no step to train (as llm.c's)")
    return cfg.max_steps if cfg.max_steps >= 0 else one_epoch


def make_model(cfg: TrainConfig, dist, backend, inputs: Inputs, attention) -> GPT2:
    """The model on the backend, with -e's weights (or llm.c's random init from --init-seed)."""
    model_cfg, params, B, T = inputs.model_cfg, inputs.params, cfg.batch_size, cfg.seq_len
    if backend.launches_kernels:   # one line saying what fits, before CuPy runs out mid-allocation
        lo, hi = dist.shard(num_parameters(model_cfg))
        backend.check_memory_fits(model_cfg, B, T, optimizer_elements=hi - lo,
                                  model_name=model_name(cfg, inputs),
                                  reserved=dist.reserved_device_memory(), sharers=dist.gpu_sharers,
                                  attention=attention, master_weights=bool(cfg.master_weights),
                                  recompute=cfg.recompute)
    model = GPT2(model_cfg, backend, B, T, seed=cfg.init_seed if params is None else None,
                 attention=attention, fuse=bool(cfg.fuse), gelu_fusion=cfg.gelu_fusion,
                 recompute=cfg.recompute, master_weights=bool(cfg.master_weights))
    model.rounding_seed = cfg.seed        # bf16: the stochastic rounding of the parameters (AdamW)
    if params is not None:
        model.load_params(params)
    return model


def open_run_dir(run: Run, state: LoopState, inputs: Inputs) -> int:
    """-o: checked against this run and claimed (gpt2np.train.rundir); with -y 1 its latest complete
    checkpoint loaded into the model, the loader and `state`. Returns the step to start from (0:
    from scratch). -x 0 writes nothing there (it evaluates the latest checkpoint with -y 1)."""
    cfg, dist = run.cfg, run.dist
    evaluate_only = run.total_steps == 0
    if not cfg.output_dir or not (cfg.resume or not evaluate_only):
        return 0
    identity = identity_of(run, inputs)
    start_step = prepare_run_dir(cfg.output_dir, identity, dist, resume=bool(cfg.resume),
                                 overwrite=cfg.overwrite, total_steps=run.total_steps,
                                 read_only=evaluate_only, evaluated=run.evaluated)
    if not start_step:
        return 0
    info = resume_checkpoint(cfg.output_dir, start_step, run.model, run.train_loader, dist)
    if not evaluate_only:
        claim_run(cfg.output_dir, identity, dist, start_step, run.evaluated)
    state.nonfinite_skipped = int(info.get("nonfinite_skipped", 0))
    if "outliers" in info:
        state.guard.load_state(info["outliers"])
    if start_step == run.total_steps:             # llm.c: the last step's evaluations, then the end
        run.say(f"{cfg.output_dir}: the run is at step {start_step} already, -x {run.total_steps}: "
                f"no step to train (give a larger -x to train on); the last step's evaluations run "
                f"again")
    return start_step


def identity_of(run: Run, inputs: Inputs) -> dict:
    """What makes checkpoints this run's (rundir.run_identity): the model, the data and the settings
    a resume must keep."""
    cfg = run.cfg
    settings = {"batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "total_batch_size": run.total_batch, "processes": run.dist.world_size,
                "zero_stage": run.dist.zero_stage, "seed": cfg.seed,
                "shuffle": cfg.shuffle, "overfit_single_batch": cfg.overfit_single_batch,
                "learning_rate": cfg.learning_rate, "warmup_steps": cfg.warmup_steps,
                "final_lr_frac": cfg.final_lr_frac, "lr_schedule": cfg.lr_schedule,
                "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "beta1": cfg.beta1,
                "beta2": cfg.beta2, "eps": cfg.eps}
    if run.backend.precision == "bf16":   # its checkpoints hold master weights fp32 runs cannot use
        settings["precision"] = "bf16"
    if inputs.params is None and (not inputs.recorded or inputs.recorded.get("init") == "random"):
        settings["init_seed"] = cfg.init_seed     # a random init's seed
    identity = run_identity(inputs.model_cfg, inputs.params, run.train_loader.files,
                            run.val_loader.files if run.val_loader else None, settings)
    if inputs.recorded:
        identity["model"] = inputs.recorded       # what the run started from, as run.json says
    return identity
