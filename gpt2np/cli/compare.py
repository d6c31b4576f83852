"""Check gpt2np against the PyTorch reference, or against an llm.c debug state.

For one batch it compares the logits, the loss and all 16 parameter gradients, then runs N AdamW
steps on that batch in both and compares the two loss curves step by step.

    gpt2np compare -e gpt2_124M.bin                       # a batch from --seed, the torch reference
    gpt2np compare -e gpt2_124M.bin --data shard.bin -b 4 -t 64 --backend cuda
    gpt2np compare -e gpt2_124M.bin --debug-state gpt2_124M_debug_state.bin --steps 0
                                                         # (llm.c's file; needs no torch)
Error measure, per tensor: max|gpt2np - ref| / max|ref| (the error relative to the tensor's scale).

    gpt2np compare -e gpt2_124M.bin --precision bf16   # against autocast bf16

--precision bf16 measures gpt2np's bf16 against PyTorch fp32, next to PyTorch's own bf16 mixed
precision (CPU autocast, TorchGPT2(autocast=True)) against the same fp32. All start from the same
weights: the model file's rounded to bf16 once (gpt2np stores bf16 weights; autocast and fp32 get
those values in fp32; how far that rounding alone moves the fp32 logits is printed beside).
Error: relative L2 per tensor, ||x - fp32|| / ||fp32||, on the logits, the per-token losses (B,T)
and every gradient (the mean loss's difference is printed too; one signed sum, it can cancel by
luck). The criterion is autocast with llm.c's storage scheme, which gpt2np keeps: the residual
stream and its gradient rounded to bf16 after every add (TorchGPT2(bf16_residual=True), the
`ac+bf16 res` column). It passes when gpt2np's error is at most BF16_RATIO (1.5) times that one's
on each tensor, and when every step of a 10-step loss curve stays within the band it sets:
|gpt2np - fp32| <= BF16_RATIO * max over the steps of |ac+bf16 res - fp32|. Plain autocast (an
fp32 residual stream) is printed beside as information.
Exit code: 0 when every check is within tolerance, 1 when one is not (or the run failed: a device or
a kernel compiler), 2 on bad input (one line).
"""
import argparse
import sys
from dataclasses import dataclass

import numpy as np

from gpt2np.backends import device_traits, get_backend
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import read_shard
from gpt2np.errors import ArgumentParser, BadInput, integer, is_finite, number, tool
from gpt2np.formats.checkpoint import load_model
from gpt2np.formats.debug_state import DebugState, read_debug_state, write_debug_state
from gpt2np.model import GPT2
from gpt2np.tensors import DECAYED_BY_DEFAULT, PARAM_NAMES
from gpt2np.torch_gpt2 import TorchGPT2  # imports no torch until a TorchGPT2 is built
from gpt2np.train_step import AdamW, train_step

# fp32 tolerances. Logits and gradients: max|a-b| / max|b| per tensor. Losses: absolute.
REL_TOL = 1e-4
LOSS_ABS_TOL = 1e-4
# Per-tensor relative tolerances that differ from REL_TOL, each with the reason it is needed.
# None so far: in fp32 every tensor of d12 agrees to ~1e-6 of its scale.
REL_TOL_OVERRIDES = {}
# --precision tf32 (the GEMM inputs rounded to a 10-bit mantissa, fp32 accumulation) against the
# fp32 reference: each rounded input moves by up to 2^-11 of itself, and the errors of the 2L+2
# matmuls compound through the layernorms; on the emulator's TF32 (rounded as the tensor cores do) a
# 4-layer model (C=64) stays under ~8e-4 of a tensor's scale and 2e-5 on the loss, so 1e-2 and 2e-3
# leave room for deeper models and the GPU's summation order.
TF32_REL_TOL = 1e-2
TF32_LOSS_ABS_TOL = 2e-3
# --precision bf16: gpt2np's error against fp32 may be at most this many times that of PyTorch
# autocast with llm.c's bf16 residual stream
BF16_RATIO = 1.5
# fewer tokens than this and the bf16 ratios are noise: an error of a few positions can be small
# by luck (at B=T=1 the per-token losses are one number)
FEW_TOKENS = 64


# ----------------------------------------------------------------------------------------------
# inputs

def make_batch(cfg: GPT2Config, B: int, T: int, seed: int = 0, data=None):
    """(x, y) int32 (B,T) from B*T+1 consecutive tokens: a shard's first ones, or
    random from seed."""
    n = B * T + 1
    if data is not None:
        shard = read_shard(data)
        if shard.size < n:
            raise ValueError(f"{data}: token shard has {shard.size} tokens, the batch needs {n}")
        tokens = np.asarray(shard[:n], dtype=np.int32)
        if tokens.max() >= cfg.vocab_size:
            raise ValueError(f"{data}: token id {tokens.max()} >= the model's vocab_size "
                             f"{cfg.vocab_size}")
    else:
        tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=n, dtype=np.int32)
    return tokens[:-1].reshape(B, T).copy(), tokens[1:].reshape(B, T).copy()


# ----------------------------------------------------------------------------------------------
# the gpt2np side

def build_model(cfg: GPT2Config, backend_name: str, B: int, T: int, params_flat, precision="fp32",
                attention="naive", recompute=None, cpu_math=None):
    """gpt2np's GPT2 on the named backend at a precision and attention, loaded with the model file's
    parameters. recompute: train.py's -r (None: its default, 0); cpu_math: train.py's --cpu-math
    (None: its default, fast)."""
    backend = get_backend(backend_name, precision, **({"math": cpu_math} if cpu_math else {}))
    recompute = 0 if recompute is None else recompute
    # load_params follows
    model = GPT2(cfg, backend, B, T, attention=attention, recompute=recompute)
    model.load_params(params_flat)
    return model


def math_text(model) -> str:
    """", fast CPU math" (or exact) for the numpy backend's report line; "" elsewhere."""
    math = getattr(getattr(model, "backend", None), "math", None)
    return f", {math} CPU math" if math else ""


def model_state(model, x, y, vocab_size: int) -> DebugState:
    """One forward + backward of the gpt2np model: logits (B,T,V), loss, grads
    {name: llm.c shape}."""
    loss = model.forward(x, y)
    logits = np.asarray(model.logits_host())[:, :, :vocab_size]
    model.backward(accumulate=False, from_logits=True)       # overwrites: no zero_grad() needed
    grads = {name: np.asarray(g) for name, g in model.grads_host().items()}
    return DebugState(x, y, logits, float(loss), grads)


def describe_adamw(lr: float, adamw: AdamW) -> str:
    return (f"lr {lr:g}, beta1 {adamw.beta1:g}, beta2 {adamw.beta2:g}, eps {adamw.eps:g}, "
            f"weight decay {adamw.weight_decay:g} on {' '.join(DECAYED_BY_DEFAULT)}, "
            f"grad clip {adamw.grad_clip:g}")


def model_step(model, x, y, step: int, lr: float, adamw: AdamW):
    """One gpt2np training step (train_step) on (x, y); step counts from 1 (AdamW's t) ->
    (loss, grad norm)."""
    loss, norm = train_step(model, lambda: (x, y), step=step - 1, lr=lr, adamw=adamw)
    return loss, norm


# ----------------------------------------------------------------------------------------------
# checks

@dataclass
class Check:
    """One compared quantity; `kind` says whether `tol` bounds the relative or
    the absolute error."""
    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    tol: float
    kind: str = "rel"
    note: str = ""

    @property
    def ok(self) -> bool:
        err = self.max_rel if self.kind == "rel" else self.max_abs
        return bool(err <= self.tol)      # False for NaN


def check_tensor(name, ours, ref, tol, kind="rel") -> Check:
    """max|ours - ref| and max|ours - ref| / max|ref| over the tensor (NaN anywhere fails)."""
    a, b = np.asarray(ours), np.asarray(ref)
    # float32 - float32 is exact for values within 2x of each other, so only widen mixed inputs
    dtype = np.float32 if a.dtype == b.dtype == np.float32 else np.float64
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    if a.shape != b.shape:
        return Check(name, b.shape, float("inf"), float("inf"), tol, kind,
                     note=f"shape {a.shape} != reference {b.shape}")
    if a.size == 0:
        return Check(name, b.shape, 0.0, 0.0, tol, kind)
    max_abs = float(np.max(np.abs(a - b)))
    scale = float(np.max(np.abs(b)))
    if np.isnan(max_abs) or np.isnan(scale):
        return Check(name, b.shape, float("nan"), float("nan"), tol, kind, note="NaN")
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Check(name, b.shape, max_abs, max_rel, tol, kind)


def compare_states(ours: DebugState, ref: DebugState, rel_tol=REL_TOL, loss_tol=LOSS_ABS_TOL,
                   overrides=None):
    """Checks for logits, loss and the 16 gradients of one batch."""
    overrides = {**REL_TOL_OVERRIDES, **(overrides or {})}
    checks = [check_tensor("logits", ours.logits, ref.logits, overrides.get("logits", rel_tol)),
              check_tensor("loss", ours.loss, ref.loss, loss_tol, kind="abs")]
    for name in PARAM_NAMES:
        if name not in ours.grads:
            checks.append(Check(name, ref.grads[name].shape, float("inf"), float("inf"),
                                overrides.get(name, rel_tol), note="missing from gpt2np's grads"))
        else:
            checks.append(check_tensor(name, ours.grads[name], ref.grads[name],
                                       overrides.get(name, rel_tol)))
    return checks


def format_checks(checks) -> str:
    lines = [f"{'tensor':<10} {'shape':<18} {'max abs err':>12} {'max rel err':>12} "
             f"{'tolerance':>13}  ok"]
    for c in checks:
        tol = f"{c.tol:.0e} {c.kind}"
        status = "ok" if c.ok else "FAIL"
        if c.note:
            status += f" ({c.note})"
        lines.append(f"{c.name:<10} {str(tuple(c.shape)):<18} {c.max_abs:>12.3e} "
                     f"{c.max_rel:>12.3e} {tol:>13}  {status}")
    lines.append("max rel err = max|gpt2np - ref| / max|ref| over the whole tensor (error relative "
                 "to the tensor's scale); the loss tolerance is absolute.")
    return "\n".join(lines)


def format_curves(ours, ref, loss_tol) -> str:
    """ours, ref: lists of (loss, grad norm) per step."""
    lines = [f"{'step':>4} {'gpt2np loss':>12} {'ref loss':>12} {'diff':>10} "
             f"{'gpt2np norm':>12} {'ref norm':>12}  ok"]
    for i, ((la, na), (lb, nb)) in enumerate(zip(ours, ref), start=1):
        diff = abs(la - lb)
        ok = "ok" if diff <= loss_tol else "FAIL"
        lines.append(f"{i:>4} {la:>12.6f} {lb:>12.6f} {diff:>10.2e} {na:>12.6f} {nb:>12.6f}  {ok}")
    lines.append(f"loss tolerance: {loss_tol:.0e} absolute at every step")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------

def parse_tolerance(text):
    name, sep, value = text.partition("=")
    if not sep or name not in ("logits",) + PARAM_NAMES:
        raise argparse.ArgumentTypeError(f"expected TENSOR=REL_TOL with TENSOR one of logits, "
                                         f"{', '.join(PARAM_NAMES)}; got {text!r}")
    try:
        tolerance = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad tolerance value in {text!r}") from None
    if not (is_finite(tolerance) and tolerance > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the tolerance must be a finite number > 0")
    return name, tolerance


def parse_args(argv=None):
    """The flags, each checked against what it allows (BadInput names the first that is not)."""
    p = ArgumentParser(prog="gpt2np compare", description=__doc__.split("\n")[0])
    p.add_argument("-e", "--model", required=True, help="llm.c model file (.bin, version 3 or 5)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--debug-state", help="llm.c debug state to check against (instead of torch)")
    src.add_argument("--write-debug-state", metavar="FILE",
                     help="also save the reference's debug state for this batch to FILE")
    p.add_argument("--backend", default="numpy",
                   help="gpt2np backend: numpy, cuda, emu (CUDA kernels on the CPU "
                        "emulator) or auto")
    p.add_argument("--steps", type=int, default=10,
                   help="AdamW steps for the loss curves (0: none)")
    p.add_argument("-b", "--batch-size", type=int, default=None, help="B (default 4)")
    p.add_argument("-t", "--seq-len", type=int, default=None,
                   help="T (default 64, or max_seq_len if less)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    p.add_argument("--data", help="llm.c token shard: take the batch from its first B*T+1 tokens")
    p.add_argument("-l", "--lr", type=float, default=1e-4)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--ref-dtype", choices=("float32", "float64"), default="float32",
                   help="precision of the PyTorch reference")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32",
                   help="gpt2np's matmuls: fp32, or tf32 (TF32 tensor cores; cuda and emu "
                   "backends) against the same fp32 reference with the tf32 tolerances; bf16 "
                   "(every backend): gpt2np's bf16 against PyTorch fp32, its error at most "
                   f"{BF16_RATIO:g}x that of PyTorch autocast bf16 with llm.c's bf16 residual "
                   "stream (default fp32)")
    p.add_argument("--attention", choices=("naive", "flash"), default="naive",
                   help="gpt2np's attention: naive, or flash (on cuda and emu: TF32 tensor cores "
                        "at fp32 and tf32, so checked with the tf32 tolerances; bf16 WMMA at bf16; "
                        "head size 64) (default naive)")
    p.add_argument("-r", "--recompute", type=int, choices=(0, 1, 2), default=None,
                   help="gpt2np's recompute, train.py's -r: 0 keep every activation, 1 recompute "
                        "the GELU in backward, 2 also the LayerNorms (default: train.py's, 0)")
    p.add_argument("--cpu-math", choices=("fast", "exact"), default=None,
                   help="the numpy backend's math, train.py's --cpu-math: fast (the default) or "
                        "exact (bitwise the NumPy reference code)")
    p.add_argument("--rel-tol", type=float, default=None,
                   help=f"relative tolerance, logits and grads (default {REL_TOL:g}; tf32: "
                        f"{TF32_REL_TOL:g})")
    p.add_argument("--loss-tol", type=float, default=None,
                   help=f"absolute tolerance, losses (default {LOSS_ABS_TOL:g}; tf32: "
                        f"{TF32_LOSS_ABS_TOL:g})")
    p.add_argument("--tol", type=parse_tolerance, action="append", default=[], metavar="TENSOR=REL",
                   help="relative tolerance for one tensor (repeatable)")
    args = p.parse_args(argv)
    # the flash kernels multiply on TF32 tensor cores at either precision (the NumPy
    # backend's flash is fp32)
    kernels = args.attention == "flash" and device_traits(args.backend).launches_kernels
    tf32 = args.precision == "tf32" or kernels
    if args.rel_tol is None:
        args.rel_tol = TF32_REL_TOL if tf32 else REL_TOL
    if args.loss_tol is None:
        args.loss_tol = TF32_LOSS_ABS_TOL if tf32 else LOSS_ABS_TOL
    for flag, value, allowed in (("--steps", args.steps, integer(0)),
                                 ("--seed", args.seed, integer(0)), ("-l", args.lr, number(0)),
                                 ("--beta1", args.beta1, number(0, 1, high_open=True)),
                                 ("--beta2", args.beta2, number(0, 1, high_open=True)),
                                 ("--eps", args.eps, number(0, low_open=True)),
                                 ("--weight-decay", args.weight_decay, number(0)),
                                 ("--grad-clip", args.grad_clip, number(0)),
                                 ("--rel-tol", args.rel_tol, number(0, low_open=True)),
                                 ("--loss-tol", args.loss_tol, number(0, low_open=True))):
        allowed.check(flag, value)
    for flag, value in (("-b", args.batch_size), ("-t", args.seq_len)):
        if value is not None:                     # None: the default, which depends on the model
            integer(1).check(flag, value)
    if args.cpu_math and not device_traits(args.backend).has_cpu_math:
        here = f" (here {device_traits('auto').label})" if args.backend == "auto" else ""
        raise BadInput(f"--cpu-math {args.cpu_math}: only for the numpy backend, not --backend "
                       f"{args.backend}{here}")
    return args


def run(args) -> int:
    """The comparison; returns the exit code. Bad input raises ValueError/OSError/ImportError."""
    cfg, params = load_model(args.model)
    if args.precision == "bf16":
        return run_bf16(args, cfg, params)
    ref_model = None
    if args.debug_state:
        ref = read_debug_state(args.debug_state, cfg)
        for flag, asked, have in (("-b", args.batch_size, ref.B), ("-t", args.seq_len, ref.T)):
            if asked is not None and asked != have:
                raise ValueError(f"{flag} {asked} disagrees with debug state "
                                 f"{args.debug_state} ({have})")
        x, y, source = ref.x, ref.y, f"debug state {args.debug_state}"
    else:
        B = 4 if args.batch_size is None else args.batch_size
        T = min(64, cfg.max_seq_len) if args.seq_len is None else args.seq_len
        if B <= 0 or not 0 < T <= cfg.max_seq_len:
            raise ValueError("need B > 0 and 0 < T <= max_seq_len "
                             f"{cfg.max_seq_len}, got B={B} T={T}")
        x, y = make_batch(cfg, B, T, args.seed, args.data)
        ref_model = TorchGPT2(cfg, params, args.ref_dtype)
        out = ref_model.forward_backward(x, y)
        ref = DebugState(x, y, out.logits, out.loss, out.grads)
        source = f"PyTorch reference ({args.ref_dtype})"
        if args.write_debug_state:
            write_debug_state(args.write_debug_state, ref, cfg)
    B, T = x.shape
    batch = f"tokens of {args.data}" if args.data else f"random tokens, seed {args.seed}"
    if args.debug_state:
        batch = "from the debug state"

    model = build_model(cfg, args.backend, B, T, params, args.precision, args.attention,
                        args.recompute, args.cpu_math)
    print(f"model {args.model}: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} "
          f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} maxT={cfg.max_seq_len}")
    print(f"batch B={B} T={T} ({batch}); gpt2np backend {args.backend} ({args.precision}, "
          f"{args.attention} attention{math_text(model)}) vs {source}")
    ours = model_state(model, x, y, cfg.vocab_size)
    checks = compare_states(ours, ref, args.rel_tol, args.loss_tol, dict(args.tol))
    print()
    print(format_checks(checks))
    failed = [c.name for c in checks if not c.ok]

    if args.steps > 0:
        adamw = AdamW(args.beta1, args.beta2, args.eps, args.weight_decay, args.grad_clip)
        del ours, ref          # the one-batch tensors (for d12, ~1 GB of gradients)
        if ref_model is None:
            ref_model = TorchGPT2(cfg, params, args.ref_dtype)
        del params
        ours_curve, ref_curve = [], []
        for step in range(1, args.steps + 1):
            ours_curve.append(model_step(model, x, y, step, args.lr, adamw))
            ref_curve.append(ref_model.step(x, y, args.lr, adamw.beta1, adamw.beta2, adamw.eps,
                                            adamw.weight_decay, DECAYED_BY_DEFAULT,
                                            adamw.grad_clip))
        print(f"\n{args.steps} AdamW steps on this batch ({describe_adamw(args.lr, adamw)}); "
              f"reference: PyTorch ({args.ref_dtype})")
        print(format_curves(ours_curve, ref_curve, args.loss_tol))
        failed += [f"loss at step {i}" for i, ((la, _), (lb, _)) in
                   enumerate(zip(ours_curve, ref_curve),
                             start=1) if not abs(la - lb) <= args.loss_tol]

    total = len(checks) + args.steps
    if failed:
        print(f"\nFAIL: {len(failed)} of {total} checks out of tolerance: {', '.join(failed)}")
        return 1
    print(f"\nOK: all {total} checks within tolerance")
    return 0


# ----------------------------------------------------------------------------------------------
# --precision bf16: against PyTorch fp32, next to PyTorch autocast bf16

def relative_l2(ours, ref) -> float:
    """||ours - ref||_2 / ||ref||_2 over the whole tensor, in float64 (NaN anywhere: NaN)."""
    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if a.shape != b.shape:
        return float("inf")
    norm = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a - b))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def token_losses(logits, y):
    """(B,T) logsumexp(logits) - logits[y] in float64, from (B,T,V) logits."""
    z = np.asarray(logits, np.float64)
    top = z.max(axis=-1)
    lse = np.log(np.exp(z - top[..., None]).sum(axis=-1)) + top
    return lse - np.take_along_axis(z, np.asarray(y)[..., None], axis=-1)[..., 0]


def bf16_errors(ours: DebugState, other: DebugState, ref: DebugState):
    """[(name, gpt2np's error, other's error)]: relative L2 against ref on the logits, the per-token
    losses and the 16 gradients."""
    losses = [token_losses(s.logits, ref.y) for s in (ours, other, ref)]
    rows = [("logits", relative_l2(ours.logits, ref.logits), relative_l2(other.logits, ref.logits)),
            ("losses", relative_l2(losses[0], losses[2]), relative_l2(losses[1], losses[2]))]
    rows += [(name, relative_l2(ours.grads[name], ref.grads[name]),
              relative_l2(other.grads[name], ref.grads[name])) for name in PARAM_NAMES]
    return rows


def bf16_ok(ours: float, criterion: float) -> bool:
    """gpt2np's error at most BF16_RATIO times the criterion's (False for NaN)."""
    return bool(ours <= BF16_RATIO * criterion)


def ratio(a, b):
    """a / b; b = 0: inf where a > 0, else 0."""
    return a / b if b > 0 else float("inf") if a > 0 else 0.0


def format_bf16(rows, autocast_rows) -> str:
    """The table of bf16_errors' rows against the criterion (autocast with llm.c's bf16 residual
    stream); beside it plain autocast's error and gpt2np's ratio to it: information only."""
    ok_head = f"ok (ratio <= {BF16_RATIO:g})"
    lines = [f"{'tensor':<10} {'gpt2np bf16':>12} {'ac+bf16 res':>12} {'ratio':>8}  {ok_head:<17}  "
             f"{'autocast':>12} {'ratio':>8}"]
    for (name, ours, res), (_, _, ac) in zip(rows, autocast_rows):
        verdict = "ok" if bf16_ok(ours, res) else "FAIL"
        lines.append(f"{name:<10} {ours:>12.3e} {res:>12.3e} {ratio(ours, res):>8.2f}  "
                     f"{verdict:<17}  {ac:>12.3e} {ratio(ours, ac):>8.2f}")
    lines += ["error against PyTorch fp32: ||x - fp32||_2 / ||fp32||_2 per tensor (relative L2; "
              "losses: the (B,T) per-token losses); all start from the same bf16-representable "
              "weights",
              "ac+bf16 res = PyTorch's bf16 mixed precision (torch.autocast('cpu', bfloat16), fp32 "
              "weights) with llm.c's storage scheme, which gpt2np keeps: the residual stream and "
              "its gradient rounded to bf16 after every add. The criterion: gpt2np's error at most "
              f"{BF16_RATIO:g}x this one's",
              "autocast = the same autocast with an fp32 residual stream (PyTorch's own): "
              "information, not part of the pass/fail"]
    return "\n".join(lines)


def bf16_curves(args, model, x, y, references):
    """--steps AdamW steps on (x, y) for gpt2np and each of references {name: TorchGPT2}, printed
    as a table of losses; returns the steps whose |gpt2np - fp32| is outside the band, BF16_RATIO
    x the largest |ac+bf16 res - fp32|."""
    adamw = AdamW(args.beta1, args.beta2, args.eps, args.weight_decay, args.grad_clip)
    curves = {name: [] for name in (*references, "gpt2np")}
    for step in range(1, args.steps + 1):
        curves["gpt2np"].append(model_step(model, x, y, step, args.lr, adamw)[0])
        for name, m in references.items():
            curves[name].append(m.step(x, y, args.lr, adamw.beta1, adamw.beta2, adamw.eps,
                                       adamw.weight_decay, DECAYED_BY_DEFAULT, adamw.grad_clip)[0])
    fp32, res, ac, ours = (curves[name] for name in ("fp32", "ac+bf16 res", "autocast", "gpt2np"))
    band = BF16_RATIO * max(abs(r - f) for r, f in zip(res, fp32))
    print(f"\n{args.steps} AdamW steps on this batch ({describe_adamw(args.lr, adamw)}): "
          f"loss of each")
    print(f"{'step':>4} {'fp32':>12} {'ac+bf16 res':>12} {'autocast':>12} {'gpt2np bf16':>12} "
          f"{'|gpt2np-fp32|':>14}  ok")
    failed = []
    for i, (f, r, a, o) in enumerate(zip(fp32, res, ac, ours), start=1):
        ok = abs(o - f) <= band
        print(f"{i:>4} {f:>12.6f} {r:>12.6f} {a:>12.6f} {o:>12.6f} {abs(o - f):>14.3e}  "
              f"{'ok' if ok else 'FAIL'}")
        if not ok:
            failed.append(f"loss at step {i}")
    print(f"band: |gpt2np - fp32| <= {BF16_RATIO:g} x max over the steps of |ac+bf16 res - fp32| "
          f"= {band:.3e}")
    return failed


def bf16_batch(args, cfg):
    """(x, y) of --precision bf16: -b (default 4) x -t (default 64, or max_seq_len if less)."""
    if args.debug_state:
        raise ValueError("--precision bf16 compares against PyTorch (fp32 and autocast bf16); it "
                         "takes no --debug-state")
    B = 4 if args.batch_size is None else args.batch_size
    T = min(64, cfg.max_seq_len) if args.seq_len is None else args.seq_len
    if B <= 0 or not 0 < T <= cfg.max_seq_len:
        raise ValueError(f"need B > 0 and 0 < T <= max_seq_len {cfg.max_seq_len}, got B={B} T={T}")
    return make_batch(cfg, B, T, args.seed, args.data)


def run_bf16(args, cfg, params) -> int:
    """gpt2np bf16, and PyTorch autocast bf16 with llm.c's bf16 residual stream (the criterion) and
    without it, each against PyTorch fp32 on the same batch and weights."""
    x, y = bf16_batch(args, cfg)
    B, T = x.shape
    # the weights rounded (RNE) to bf16 once
    model = build_model(cfg, args.backend, B, T, params, "bf16", args.attention, args.recompute,
                        args.cpu_math)
    start = np.asarray(model.params_host(), np.float32)          # the same weights for all of them
    weights_only = relative_l2(TorchGPT2(cfg, start).forward_backward(x, y).logits,
                               TorchGPT2(cfg, params).forward_backward(x, y).logits)
    references = {"fp32": TorchGPT2(cfg, start, "float32"),
                  "ac+bf16 res": TorchGPT2(cfg, start, "float32", autocast=True,
                                           bf16_residual=True),
                  "autocast": TorchGPT2(cfg, start, "float32", autocast=True)}
    states = {}
    for name, m in references.items():
        out = m.forward_backward(x, y)
        states[name] = DebugState(x, y, out.logits, out.loss, out.grads)
    ref, res, ac = states["fp32"], states["ac+bf16 res"], states["autocast"]
    ours = model_state(model, x, y, cfg.vocab_size)
    ours = DebugState(x, y, np.asarray(ours.logits, np.float32), ours.loss,
                      {n: np.asarray(g, np.float32) for n, g in ours.grads.items()})
    batch = f"tokens of {args.data}" if args.data else f"random tokens, seed {args.seed}"
    print(f"model {args.model}: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} "
          f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} maxT={cfg.max_seq_len}")
    print(f"batch B={B} T={T} ({batch}); gpt2np backend {args.backend} (bf16: bf16 weights, "
          f"activations and gradients, fp32 math; {args.attention} attention{math_text(model)}) "
          f"and PyTorch autocast bf16, each against PyTorch fp32\n")
    rows = bf16_errors(ours, res, ref)
    print(format_bf16(rows, bf16_errors(ours, ac, ref)))
    if B * T < FEW_TOKENS:
        print(f"note: only B*T = {B * T} of {FEW_TOKENS} tokens: the per-token losses and the "
              f"gradients rest on that few positions, so autocast's error can be small by luck and "
              f"the ratios say little; use B*T >= {FEW_TOKENS} for the criterion to mean something")
    others = (("ac+bf16 res", res), ("autocast", ac), ("gpt2np bf16", ours))
    print(f"mean loss: fp32 {ref.loss:.6f}, "
          + ", ".join(f"{name} {s.loss:.6f} ({s.loss - ref.loss:+.2e})" for name, s in others))
    print(f"(rounding the model file's weights to bf16 alone moves the fp32 logits by "
          f"{weights_only:.3e}, relative L2)")
    failed = [name for name, o, r in rows if not bf16_ok(o, r)]
    if args.steps > 0:
        failed += bf16_curves(args, model, x, y, references)
    total = len(rows) + args.steps
    criterion = f"{BF16_RATIO:g}x the error of autocast with llm.c's bf16 residual stream"
    if failed:
        print(f"\nFAIL: {len(failed)} of {total} checks above {criterion}: {', '.join(failed)}")
        return 1
    print(f"\nOK: all {total} checks within {criterion}")
    return 0


@tool
def main(argv=None) -> int:
    """The comparison from the flags: 0 all within tolerance, 1 a check failed, 2 bad
    input (one line)."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
