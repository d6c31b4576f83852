"""GPT-2 model configuration, llm.c's model descriptors (d12, gpt2:d24, gpt3:c768, ...), and the
training settings (TrainConfig)."""
import re
from dataclasses import Field, dataclass, field, fields, replace
from typing import get_args

from gpt2np.errors import (
    SWITCH,
    TEXT,
    Allowed,
    BadInput,
    integer,
    is_finite,
    is_int,
    number,
    one_of,
)


@dataclass(frozen=True)
class GPT2Config:
    """Hyperparameters of the network, named as in llm.c's GPT2Config.

    max_seq_len (maxT): positions in wpe.  vocab_size (V): real tokens.
    padded_vocab_size (Vp): V rounded up to a multiple of 128 (wte rows).
    """
    max_seq_len: int = 1024
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    num_layers: int = 12
    num_heads: int = 12
    channels: int = 768

    def __post_init__(self):
        checks = [
            (self.max_seq_len > 0, "max_seq_len must be positive"),
            (self.vocab_size > 0, "vocab_size must be positive"),
            (self.padded_vocab_size >= self.vocab_size, "padded_vocab_size must be >= vocab_size"),
            (self.num_layers > 0, "num_layers must be positive"),
            (self.num_heads > 0, "num_heads must be positive"),
            (self.channels > 0 and self.num_heads > 0 and self.channels % self.num_heads == 0,
             "channels must be a positive multiple of num_heads"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"GPT2Config: {msg} (got {self})")

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    def describe(self) -> str:
        return (f"max_seq_len: {self.max_seq_len}\nvocab_size: {self.vocab_size}\n"
                f"padded_vocab_size: {self.padded_vocab_size}\nnum_layers: {self.num_layers}\n"
                f"num_heads: {self.num_heads}\nchannels: {self.channels}")


def pad_vocab(vocab_size: int, multiple: int = 128) -> int:
    """Vp: the vocabulary rounded up to a multiple (llm.c pads 50257 to 50304)."""
    return (vocab_size + multiple - 1) // multiple * multiple


# llm.c's GPT-2 depth presets (-e dL): name -> (num_layers, num_heads, channels); d6, d60, d72, d84
# are llm.c's unofficial sizes (30M, 2.7B, 7.3B, 12.2B), the others GPT-2's 124M, 350M, 774M, 1558M
PRESETS = {
    "d6": (6, 6, 384),
    "d12": (12, 12, 768),
    "d24": (24, 16, 1024),
    "d36": (36, 20, 1280),
    "d48": (48, 25, 1600),
    "d60": (60, 30, 1920),
    "d72": (72, 30, 2880),
    "d84": (84, 36, 3456),
}
# llm.c's GPT-3 sizes (-e gpt3:cC): channels -> (num_layers, head size); context 2048. 5140 (13B) is
# in llm.c's table but its head size does not divide it (llm.c stops on an assert):
# refused here in one line.
GPT3_SIZES = {384: (6, 64), 768: (12, 64), 1024: (24, 64), 1536: (24, 96), 2048: (24, 128),
              2560: (32, 80), 4096: (32, 128), 5140: (40, 128), 12288: (96, 128)}
DESCRIPTORS = "dL or gpt2:dL (L = " + ", ".join(p[1:] for p in PRESETS) + ") or gpt3:cC (C = " + \
    ", ".join(map(str, GPT3_SIZES)) + ")"


def descriptor(spec: str, vocab_size: int = 50257):
    """The GPT2Config of llm.c's model descriptor `spec` ('d12', 'gpt2:d12', 'gpt3:c768'; random
    init), None when spec is not written as one; a ValueError for a size llm.c
    does not have ('d7')."""
    gpt2 = re.fullmatch(r"(?:gpt2:)?d(\d+)", spec)
    gpt3 = re.fullmatch(r"gpt3:c(\d+)", spec)
    if gpt2:
        if f"d{int(gpt2[1])}" not in PRESETS:
            raise ValueError(f"{spec}: llm.c has no GPT-2 of depth {int(gpt2[1])}; its model "
                             f"descriptors are {DESCRIPTORS}")
        L, NH, C = PRESETS[f"d{int(gpt2[1])}"]
        return GPT2Config(1024, vocab_size, pad_vocab(vocab_size), L, NH, C)
    if gpt3:
        C = int(gpt3[1])
        if C not in GPT3_SIZES:
            raise ValueError(f"{spec}: llm.c has no GPT-3 of {C} channels; its model descriptors "
                             f"are {DESCRIPTORS}")
        L, head_size = GPT3_SIZES[C]
        if C % head_size:
            raise ValueError(f"{spec}: llm.c's head size for {C} channels, {head_size}, "
                             "does not divide them")
        return GPT2Config(2048, vocab_size, pad_vocab(vocab_size), L, C // head_size, C)
    return None


def preset(name: str, max_seq_len: int | None = None, vocab_size: int = 50257) -> GPT2Config:
    """The config of an llm.c model descriptor such as 'd12' (GPT-2 124M when V=50257) or
    'gpt3:c768'; max_seq_len: the descriptor's own (1024, GPT-3's 2048) unless given."""
    cfg = descriptor(name, vocab_size)
    if cfg is None:
        raise ValueError(f"unknown model preset {name!r}: expected {DESCRIPTORS}")
    return cfg if max_seq_len is None else replace(cfg, max_seq_len=max_seq_len)


def _setting(flag, default=None, help="", *, cpu_gpu=None, choices=None, metavar=None,
             default_text=None, allowed: Allowed | None = None, what=""):
    """A TrainConfig field: its llm.c flag, help, argparse choices/metavar, the values it allows
    (`allowed`, and `what` it is, for the error message; choices, switches and text need neither)
    and, where llm.c's CPU (train_gpt2.c) and GPU (train_gpt2.cu) trainers differ, the (CPU, GPU)
    defaults that fill a None once the backend is known."""
    return field(default=default, metadata={"flag": flag, "help": help,
                                            "cpu_gpu": cpu_gpu, "choices": choices,
                                            "metavar": metavar, "default_text": default_text,
                                            "allowed": allowed, "what": what})


COUNT = integer(1)                                   # a size: at least one
UINT32 = Allowed(lambda v: is_int(v) and 0 <= v < 2 ** 32, "an integer from 0 to 4294967295")
OFF_OR_EVERY = integer(0, words="an integer >= 0 (0 = never)")


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting, by name; train.py maps llm.c's flags (in each
    field's metadata) onto it.

    None in a field with cpu_gpu metadata means "llm.c's default for the device": see
    with_device_defaults.
    """
    train_data: str | None = _setting("-i", help="train token shards (glob); the default set is "
                                                 "prepared on first use",
                                      metavar="PATTERN", default_text="tinyshakespeare train split")
    val_data: str | None = _setting("-j",
                                    help="val token shards (glob); -i without -j: no validation",
                                    metavar="PATTERN", default_text="tinyshakespeare val split")
    model: str = _setting("-e", "gpt2_124M.bin",
                          "llm.c model file (fetched if missing), llm.c's model descriptor for "
                          "random init (d6..d84, gpt2:dL, gpt3:cC), a Hugging Face GPT-2 folder "
                          "(config.json + model.safetensors) or a Hub id (gpt2, "
                          "openai-community/gpt2-medium)", metavar="MODEL")
    output_dir: str | None = _setting("-o", help="output dir for main.log and checkpoints",
                                      metavar="DIR", default_text="none")
    batch_size: int | None = _setting("-b", help="micro batch size B", cpu_gpu=(4, 4),
                                      allowed=COUNT, what="the micro batch size B")
    seq_len: int | None = _setting("-t", help="sequence length T", cpu_gpu=(64, 1024),
                                   allowed=COUNT, what="the sequence length T")
    total_batch_size: int = _setting(
        "-d", -1, "total batch size in tokens, by gradient accumulation",
        default_text="B*T*processes", what="the total batch size",
        allowed=integer(1, also=(-1,), words="-1 (B*T*processes) or a number of tokens >= 1"))
    max_steps: int | None = _setting(
        "-x", help="max steps, -1 = one epoch", cpu_gpu=(40, -1), what="the max steps",
        allowed=integer(-1, words="-1 (one epoch), 0 (no training: only validate and sample) or a "
                                  "number of steps >= 1"))
    learning_rate: float = _setting("-l", 3e-4, "learning rate", allowed=number(0, low_open=True),
                                    what="the learning rate")
    warmup_steps: int = _setting("-u", 0, "warmup iterations", allowed=integer(0),
                                 what="the warmup iterations")
    final_lr_frac: float = _setting("-q", 1.0, "final lr as a fraction of -l, 1.0 = no decay",
                                    allowed=number(0, 1), what="the final lr fraction")
    lr_schedule: str = _setting("-k", "cosine", "lr schedule",
                                choices=("cosine", "linear", "constant", "wsd"))
    weight_decay: float = _setting("-c", 0.0, "weight decay, on the 2-D tensors", allowed=number(0),
                                   what="the weight decay")
    val_every: int | None = _setting("-v",
                                     help="val loss every N steps, 0 = never", cpu_gpu=(10, 20),
                                     allowed=OFF_OR_EVERY, what="the validation interval")
    val_max_batches: int | None = _setting("-m", help="max val batches, -1 = all", cpu_gpu=(5, 20),
                                           what="the max val batches",
                                           allowed=integer(1, also=(-1,),
                                                           words="-1 (all) or an integer >= 1; use "
                                                           "-v 0 to turn validation off"))
    hellaswag_every: int = _setting("--hellaswag",
                                    0, "HellaSwag acc_norm every N steps (and at the last), "
                                       "logged as `s:STEP eval:ACC`; 0 = never", metavar="N",
                                    allowed=OFF_OR_EVERY, what="the HellaSwag interval")
    hellaswag_data: str | None = _setting("--hellaswag-data",
                                          help="HellaSwag jsonl for --hellaswag", metavar="PATH",
                                          default_text="hellaswag_val.jsonl in the download cache")
    hellaswag_eval: int = _setting("-h", 0, "1 = HellaSwag acc_norm at every -v step after 0 and "
                                            "the last, as llm.c's -h 1, skipped without its data "
                                            "(--hellaswag N for another interval); -h "
                                   "alone prints this help", choices=(0, 1))
    sample_every: int | None = _setting("-s",
                                        help="sample every N steps, 0 = never", cpu_gpu=(20, 20),
                                        allowed=OFF_OR_EVERY, what="the sampling interval")
    gen_tokens: int = _setting("-g", 64, "tokens to generate per sample", allowed=integer(0),
                               what="the tokens to generate")
    checkpoint_every: int = _setting("-n", 0, "checkpoint every N steps into -o, 0 = never",
                                     allowed=OFF_OR_EVERY, what="the checkpoint interval")
    checkpoints_keep: int = _setting("-nk", 0, "keep the last N checkpoints in -o, deleting older "
                                               "ones once a newer one is complete; 0 = keep all",
                                     metavar="N", allowed=integer(0),
                                     what="the number of checkpoints kept")
    major_checkpoint_every: int = _setting("-nm", 0, "with -nk: the checkpoints at multiples of "
                                                     "N steps are never "
                                           "deleted; 0 = none", metavar="N", allowed=OFF_OR_EVERY,
                                           what="the major checkpoint interval")
    resume: int = _setting("-y", 0, "1 = resume from the latest checkpoint in -o", choices=(0, 1))
    overfit_single_batch: int = _setting("-a", 0, "1 = overfit a single batch, for debugging",
                                         choices=(0, 1))
    zero_stage: int = _setting("-z", 0, "ZeRO stage under mpiexec: 0 = plain data parallel, 1 = "
                                        "optimizer state sharded across ranks (as llm.c: stage 0 "
                                        "when the parameters do not divide evenly over the ranks; "
                                        "2 and 3 run stage 0, with a note)", choices=(0, 1, 2, 3))
    dist_timeout: float = _setting(
        "--dist-timeout", 600.0, "under mpiexec: abort all ranks when a collective takes longer, "
                                 "as a rank died or hangs; 0 = wait forever", metavar="SECONDS",
        allowed=number(0, words="a finite number of seconds >= 0 (0 = wait forever)"),
        what="the collective timeout")
    device: str = _setting("--device", "auto",
                           "auto = cuda if there is a GPU, else cpu; cpu and numpy are the same "
                           "backend; emu = the CUDA kernels on the CPU emulator (slow: tiny "
                           "models, to see or test the CUDA path without a GPU; its -b/-t/-x "
                           "defaults are the CPU's, its kernel "
                           "choices the GPU's)", choices=("auto", "cpu", "numpy", "cuda", "emu"))
    seed: int = _setting("--seed", 1337, "the sampling seed (llm.c's 1337) and bf16's stochastic "
                                         "rounding seed", allowed=integer(0), what="the seed")
    init_seed: int = _setting("--init-seed", 42,
                              "the random init's mt19937 seed for a model descriptor (-e d12): "
                              "llm.c's init, bit for bit, with llm.c's 42", allowed=UINT32,
                              what="the init seed")
    shuffle: int = _setting("--shuffle", 1, "1 = read the train shards and samples in llm.c's "
                                            "shuffled order (its permutations, a stream seeded 42 "
                                            "+ rank; off with -a 1), 0 = in file order",
                            choices=(0, 1))
    temperature: float = _setting("--temperature", 1.0, "sampling temperature, 0 = greedy",
                                  allowed=number(0, words="a finite number >= 0 (0 = greedy)"),
                                  what="the sampling temperature")
    top_k: int = _setting("--top-k", 0, "sample from the k most likely tokens, 0 = all",
                          allowed=integer(0, words="an integer >= 0 (0 = all)"), what="the top-k")
    grad_clip: float = _setting("--grad-clip", 1.0, "global-norm gradient clipping, 0 = off",
                                allowed=number(0, words="a finite number >= 0 (0 = off)"),
                                what="the clipping norm")
    beta1: float = _setting("--beta1", 0.9, "AdamW beta1", allowed=number(0, 1, high_open=True),
                            what="AdamW's beta1")
    beta2: float = _setting("--beta2", 0.95, "AdamW beta2", allowed=number(0, 1, high_open=True),
                            what="AdamW's beta2")
    eps: float = _setting("--eps", 1e-8, "AdamW epsilon", allowed=number(0, low_open=True),
                          what="AdamW's epsilon")
    precision: str | None = _setting(
        "--precision", None,
        "math of the matmuls: tf32 (TF32 tensor cores, 10-bit mantissa inputs, fp32 "
        "accumulation) or fp32 (exact); tf32 needs a GPU with tensor cores (sm_80+); bf16: "
        "bf16 weights, gradients and activations, fp32 math, master weights and AdamW, llm.c's "
        "scheme (the CPU reference; the CUDA kernels' bf16 build on sm_80+ and --device emu)",
        choices=("fp32", "tf32", "bf16"),
        default_text="tf32 on a GPU with tensor cores and fp32 elsewhere")
    tf32: bool = _setting("--tf32", False,
                          "the same as --precision tf32 (kept for llm.c-style command lines)")
    enable_tf32: int = _setting("-f", 1, "llm.c's TF32 switch: 0 = exact fp32 matmuls where "
                                         "--precision is not given (--precision fp32), 1 = the "
                                         "default precision", choices=(0, 1))
    master_weights: int = _setting("-w", 1,
                                   "bf16: 1 = AdamW updates fp32 master weights (llm.c's default), "
                                   "0 = it updates the bf16 weights directly (stochastic rounding, "
                                   "no fp32 copy); no effect in fp32/tf32", choices=(0, 1))
    gelu_fusion: int | None = _setting("-ge", help="GELU in the fc GEMM's cuBLASLt epilogues (with "
                                                   "--fuse 1): 0 = none, 1 = forward, 2 = forward "
                                                   "and backward; --fuse 0 has no epilogues",
                                       choices=(0, 1, 2), default_text="2 with --fuse 1")
    recompute: int = _setting("-r", 0, "recompute activations in backward instead of keeping one "
                                       "per layer: 0 = none (gpt2np's default: the fastest), 1 = "
                                       "GELU (llm.c's default), 2 = GELU and LayerNorm "
                              "(less memory, a few more launches)", choices=(0, 1, 2))
    attention: str | None = _setting("--attention", help="causal self-attention: flash (tiles, "
                                     "online softmax, the probabilities recomputed in backward; on "
                                     "a GPU TF32 tensor cores, head size 64, sm_80+) or naive (the "
                                     "(T,T) probabilities kept)", cpu_gpu=("naive", "flash"),
                                     choices=("flash", "naive"))
    fuse: int | None = _setting("--fuse", help="1 = fused kernels: bias, GELU, dGELU and "
                                "bias-gradient GEMM epilogues (cuBLASLt), residual + LayerNorm "
                                "in one kernel, one-pass LayerNorm backward; 0 = one kernel "
                                "per op. On the CPU the fused ops compose the same NumPy "
                                "ops (same numbers)", cpu_gpu=(0, 1), choices=(0, 1))
    cpu_math: str | None = _setting(
        "--cpu-math", None,
        "CPU only: fast = GELU, LayerNorm, causal attention (per head, the masked half skipped), "
        "the classifier and the gradient norm as one vectorized C loop each (own e^x within 1.02 "
        "ulp, row sums in double; not bitwise NumPy's, tested to a documented tolerance); exact = "
        "bitwise the NumPy reference code", choices=("fast", "exact"), default_text="fast")
    profile_steps: int = _setting("--profile", 0, "profile N steps after a warm-up step: kernel "
                                                  "table, module tree, range summary; files in "
                                                  "-o/profile (./profile without -o)", metavar="N",
                                  allowed=integer(0, words="an integer >= 0 (0 = off)"),
                                  what="the number of profiled steps")
    log_gpu_every: int = _setting("-lg", -1, "every N steps, a line of the GPU's memory use under "
                                             "the step line (llm.c's -lg; its NVML figures, "
                                             "utilization, clocks, power and temperature, are "
                                  "not read here); -1 or 0 = never", metavar="N",
                                  allowed=integer(-1, words="an integer >= -1 (-1, 0 = never)"),
                                  what="the GPU log interval")
    nvtx: int = _setting("--nvtx", 1, "NVTX ranges for nsys, free without a profiler",
                         choices=(0, 1))
    overwrite: bool = _setting("--overwrite", False,
                               "start a new run in an -o that holds another run's files: "
                               "move them into -o/previous-TIME/ first (nothing is deleted)")
    cuda_graphs: int = _setting("--cuda-graphs", 1,
                                "CUDA backend: capture each training step's launches once per "
                                "shape as a CUDA graph and replay it (one launch per step; under "
                                "mpiexec three, the collectives between them); 0 = launch eagerly "
                                "(profiling always does, for per-kernel numbers)", choices=(0, 1))
    skip_update_lossz: float = _setting(
        "-sl", 0.0, "skip the update of a step whose loss lies more than this many standard "
                    "deviations above the mean of the last 128 steps; 0 = off", metavar="Z",
        allowed=number(0, words="a finite number >= 0 (0 = off)"), what="the loss z-score limit")
    skip_update_gradz: float = _setting("-sg", 0.0,
                                        "the same for the gradient norm; 0 = off", metavar="Z",
                                        allowed=number(0, words="a finite number >= 0 (0 = off)"),
                                        what="the grad-norm z-score limit")
    num_processes: int | None = _setting("-pn", help="llm.c's multi-node count of processes: the "
                                         "ranks come from mpiexec (or srun --mpi=pmix), and as "
                                         "llm.c's -pi mpi, mpiexec's count is "
                                         "used (a different value given is noted)", metavar="N",
                                         default_text="mpiexec's", allowed=COUNT,
                                         what="the number of processes")
    process_rank: int | None = _setting("-pr", help="this process's rank: mpiexec's is used (a "
                                                    "different value given is noted)",
                                        metavar="RANK", default_text="mpiexec's",
                                        allowed=integer(0), what="the process rank")
    gpus_per_node: int | None = _setting("-pg", help="GPUs per node: not needed, each rank takes "
                                         "the GPU of its place among its node's ranks, as llm.c's "
                                         "-pi mpi does", metavar="N", default_text="mpiexec's",
                                         allowed=COUNT, what="the GPUs per node")
    nccl_init_method: str = _setting("-pi", "mpi",
                                     "how ranks find each other: mpi (gpt2np's only one; "
                                     "llm.c's tcp and fs need no MPI, here run under mpiexec or "
                                     "srun --mpi=pmix)", choices=("mpi", "tcp", "fs"))
    server_ip: str | None = _setting("-ps", help="llm.c's server for -pi tcp (not supported)",
                                     metavar="IP", default_text="none")
    fs_path: str | None = _setting("-pf", help="llm.c's shared folder for -pi fs (not supported)",
                                   metavar="PATH", default_text="none")
    skip_nonfinite: int = _setting("--skip-nonfinite",
                                   0, "skip (do not apply) up to N steps whose loss or grad "
                                      "norm is NaN/Inf before stopping; 0 = stop at the first",
                                   metavar="N", allowed=integer(0),
                                   what="the number of non-finite steps to skip")

    def validate(self) -> "TrainConfig":
        """Self, if every setting is allowed and none contradicts another; else BadInput (a
        ValueError) naming the flag(s), the value(s) and what is allowed. Device-dependent settings
        still None are not checked: call it again on with_device_defaults' copy."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and type(None) in get_args(f.type):
                continue
            allowed(f).check(f.metadata["flag"], value, f.metadata["what"])
        B, T, steps, profiled = self.batch_size, self.seq_len, self.max_steps, self.profile_steps
        if self.tf32 and self.precision in ("fp32", "bf16"):
            raise BadInput(f"--tf32 with --precision {self.precision}: --tf32 means --precision "
                           "tf32; give one of them")
        if not self.enable_tf32 and (self.tf32 or self.precision == "tf32"):
            raise BadInput("-f 0 with --precision tf32: -f 0 turns TF32 off; give one of them")
        if self.nccl_init_method != "mpi" or self.server_ip is not None or self.fs_path is not None:
            given = (f"-pi {self.nccl_init_method}" if self.nccl_init_method != "mpi"
                     else "-ps" if self.server_ip is not None else "-pf")
            raise BadInput(f"{given}: gpt2np's ranks find each other through MPI (llm.c's tcp and "
                           "fs init are not here); start them with mpiexec (or srun --mpi=pmix) "
                           "and leave out -pi, -ps and -pf")
        if self.hellaswag_eval and self.hellaswag_every:
            raise BadInput(f"-h 1 with --hellaswag {self.hellaswag_every}: -h 1 evaluates at every "
                           "-v step; give one of them")
        if self.hellaswag_eval and self.val_every == 0:
            raise BadInput("-h 1 with -v 0: -h 1 evaluates HellaSwag at the -v steps; use "
                           "--hellaswag N for an interval of its own")
        if self.checkpoints_keep and (not self.output_dir or self.checkpoint_every <= 0):
            raise BadInput(f"-nk {self.checkpoints_keep} "
                           + ("without -o" if not self.output_dir
                              else f"with -n {self.checkpoint_every}")
                           + ": -nk keeps the last checkpoints that -n writes "
                           "into -o; there are none")
        if self.major_checkpoint_every and not self.checkpoints_keep:
            raise BadInput(f"-nm {self.major_checkpoint_every} without -nk: major checkpoints are "
                           "the ones -nk never deletes; without -nk every checkpoint is kept")
        # fuse None (device default not known yet): checked again
        if self.gelu_fusion and self.fuse == 0:
            raise BadInput(f"-ge {self.gelu_fusion} with --fuse 0: the GELU epilogues are fused "
                           "GEMMs; give -ge 0 (or leave it out) with --fuse 0, or --fuse 1 (on the "
                           "CPU --fuse defaults to 0)")
        if self.resume and not self.output_dir:
            raise BadInput("-y 1 without -o: resuming reads the checkpoints in -o DIR")
        if self.overwrite and not self.output_dir:
            raise BadInput("--overwrite without -o: it moves the files of -o DIR "
                           "aside; there is no -o")
        if self.hellaswag_data and not (self.hellaswag_eval or self.hellaswag_every):
            raise BadInput(f"--hellaswag-data {self.hellaswag_data} without -h 1 or --hellaswag N: "
                           "nothing evaluates HellaSwag")
        if self.checkpoint_every > 0 and not self.output_dir:
            raise BadInput(f"-n {self.checkpoint_every} without -o: checkpoints are written into "
                           "-o DIR (or use -n 0)")
        if profiled > 0 and steps is not None and 0 <= steps < profiled + 1:
            raise BadInput(f"--profile {profiled} with -x {steps}: profiling takes one "
                           "warm-up step, then "
                           f"{profiled} profiled; -x must be >= {profiled + 1} (or -1, one epoch)")
        if (self.total_batch_size > 0 and B is not None and T is not None
            and self.total_batch_size % (B * T)):
            raise BadInput(f"-d {self.total_batch_size} with -b {B} -t {T}: the total batch size "
                           f"must be a multiple of B*T = {B * T} (times the number of processes)")
        return self

    @property
    def hellaswag_interval(self) -> int:
        """Steps between HellaSwag evaluations (0 = never): --hellaswag N, or the -v interval
        for llm.c's -h 1."""
        if self.hellaswag_eval:
            return self.val_every or 0
        return self.hellaswag_every

    def hellaswag_due(self, step: int) -> bool:
        """Whether HellaSwag runs before step `step` (0-based; the last step's comes on top):
        --hellaswag N at every multiple of N from 0; -h 1 at the -v steps after
        0, as llm.c's -h 1."""
        every = self.hellaswag_interval
        return every > 0 and step % every == 0 and (step > 0 or not self.hellaswag_eval)

    @property
    def requested_precision(self) -> str | None:
        """The precision asked for: --precision, or tf32 for --tf32; None = the device's default
        (see gpt2np.backends.resolve_precision: tf32 on a GPU with tensor cores, fp32 elsewhere)."""
        if self.tf32:
            return "tf32"
        return self.precision or (None if self.enable_tf32 else "fp32")

    def with_device_defaults(self, traits) -> "TrainConfig":
        """A copy with llm.c's CPU or GPU default in every device-dependent field left None. traits:
        the device's (gpt2np.backends.device_traits): on_gpu takes the GPU's; launches_kernels
        without on_gpu (the emulator) runs the GPU's kernel path (KERNEL_PATH_FIELDS: its defaults
        are the GPU's) at CPU speed (every other default is the CPU's: short
        sequences, few steps)."""
        def column(name):
            return 1 if traits.on_gpu or (traits.launches_kernels
                                          and name in KERNEL_PATH_FIELDS) else 0
        return replace(self, **{f.name: f.metadata["cpu_gpu"][column(f.name)] for f in fields(self)
                                if f.metadata["cpu_gpu"] and getattr(self, f.name) is None})


# the device-dependent settings that choose kernels, not sizes: the emulator takes the
# GPU's defaults for these
KERNEL_PATH_FIELDS = ("attention", "fuse")


def value_type(f: Field) -> type:
    """The type a setting's flag parses to: int for `int | None`."""
    return next((t for t in get_args(f.type) if t is not type(None)), f.type)


def allowed(f: Field) -> Allowed:
    """The values a setting allows: its rule, or its choices, a switch's True/False, text; a number
    without a rule (tests/test_bad_input.py asks every number for one) at least has the right
    type and is finite."""
    m, kind = f.metadata, value_type(f)
    if m["allowed"]:
        return m["allowed"]
    if m["choices"]:
        return one_of(m["choices"])
    return {bool: SWITCH, str: TEXT, int: Allowed(is_int, "an integer"),
            float: Allowed(is_finite, "a finite number")}[kind]


def default_text(f: Field) -> str | None:
    """A setting's default in words, for --help: llm.c's CPU/GPU defaults, a described
    default, or the value."""
    m = f.metadata
    if m["cpu_gpu"]:
        cpu, gpu = m["cpu_gpu"]
        return str(cpu) if cpu == gpu else f"{cpu} on the CPU, {gpu} on a GPU"
    if m["default_text"]:
        return m["default_text"]
    return None if f.default is None or value_type(f) is bool else str(f.default)
