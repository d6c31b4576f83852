"""Helpers of bench/gpu_acceptance.sh: it runs the stages, this file does the Python parts.

    python bench/gpu_acceptance.py setup DIR [--full]      # synthetic shards and model files in DIR
    python bench/gpu_acceptance.py preflight --device cuda  # what is there, as shell assignments
    python bench/gpu_acceptance.py loss-falls DIR/main.log [--min-drop 0.5]
    python bench/gpu_acceptance.py ncu-agrees DIR/ncu.log [--tolerance 0.10]
    python bench/gpu_acceptance.py summary DIR  # DIR/stages.tsv -> DIR/summary.txt, summary.json

Everything the stages read is written here, so that the acceptance needs no data file and no
network: train and val shards of a repeating random sequence over 100 token ids (any GPT-2 learns
it: the loss falls within a few steps), `tiny.bin` (2 layers, C=32: the compute-sanitizer step and
the emulator smoke), `small.bin` (4 layers, C=128: the PyTorch parity checks; --full: 12 layers,
C=768, GPT-2's vocabulary, d12's shape).
"""
import argparse
import importlib
import json
import os
import re
import shlex
import sys

import numpy as np

SYNTH_VOCAB = 100            # token ids of the synthetic shards: < every model's vocab_size here
# the shards repeat a random sequence of this length (learnable in a few steps)
SYNTH_PERIOD = 256
TRAIN_TOKENS = 1 << 20       # 256 batches of B=4, T=1024: --full's 200 steps in one epoch
VAL_TOKENS = 1 << 15


def setup(out, full=False):
    """Write DIR/train_000.bin, DIR/val_000.bin, DIR/tiny.bin, DIR/small.bin; print
    what was written."""
    from gpt2np.config import GPT2Config, preset
    from gpt2np.datasets.data import write_shard
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.tensors import PARAM_NAMES, num_parameters, param_shapes, views

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(1337)
    period = rng.integers(0, SYNTH_VOCAB, SYNTH_PERIOD)
    write_shard(os.path.join(out, "train_000.bin"), np.resize(period, TRAIN_TOKENS))
    write_shard(os.path.join(out, "val_000.bin"), np.resize(np.roll(period, 7), VAL_TOKENS))

    def random_model(path, cfg, seed):
        """llm.c's init (as GPT2.init_random), written as an llm.c model file."""
        flat = np.zeros(num_parameters(cfg), np.float32)
        hv = views(flat, param_shapes(cfg))
        r = np.random.default_rng(seed)
        for name in PARAM_NAMES:
            if name in ("ln1w", "ln2w", "lnfw"):
                hv[name][...] = 1.0
            elif name in ("wte", "wpe", "qkvw", "fcw", "attprojw", "fcprojw"):
                std = (0.02 if name in ("wte", "wpe", "qkvw", "fcw")
                       else 0.02 / np.sqrt(2 * cfg.num_layers))
                hv[name][...] = r.standard_normal(hv[name].shape, np.float32) * np.float32(std)
        hv["wte"][cfg.vocab_size:] = 0.0
        save_model(path, cfg, flat)
        return (f"{path}: L={cfg.num_layers} C={cfg.channels} V={cfg.vocab_size}, "
                f"{flat.size / 1e6:.2f}M parameters")

    tiny = GPT2Config(max_seq_len=64, vocab_size=SYNTH_VOCAB, padded_vocab_size=128, num_layers=2,
                      num_heads=2, channels=32)
    small = preset("d12") if full else GPT2Config(max_seq_len=256, vocab_size=512,
                                                  padded_vocab_size=512,
                                                  num_layers=4, num_heads=4, channels=128)
    print(f"{out}/train_000.bin ({TRAIN_TOKENS} tokens), {out}/val_000.bin ({VAL_TOKENS} tokens): "
          f"a random sequence of {SYNTH_PERIOD} ids < {SYNTH_VOCAB}, repeated")
    print(random_model(os.path.join(out, "tiny.bin"), tiny, 1))
    print(random_model(os.path.join(out, "small.bin"), small, 2))
    return 0


def _try(fn):
    try:
        return fn(), None
    except Exception as e:                      # anything: the line says what
        return None, " ".join(f"{type(e).__name__}: {e}".split())[:200]


def preflight(device):
    """Shell assignments: CUDA_OK/CUDA_WHY (gpt2np's cuda_problem line), TORCH_OK/TORCH_WHY (torch
    with a GPU; TORCH_CPU_OK: torch at all, enough for the parity reference), PYTEST_OK/PYTEST_WHY,
    NCCL_OK/NCCL_WHY, and WHEELS: the pip packages to bring for what is missing (pip install
    --no-index --find-links WHEELS ...)."""
    out, wheels = {}, []

    def put(key, ok, why=""):
        out[f"{key}_OK"], out[f"{key}_WHY"] = "1" if ok else "0", why or ""

    if device == "cuda":
        from gpt2np.backends import cuda_problem
        problem = cuda_problem()
        put("CUDA", problem is None, problem)
        if problem:
            if "CuPy is not installed" in problem:
                wheels.append("cupy-cuda13x")
            wheels += re.findall(r"pip install '([a-z0-9-]+)[^']*'", problem)
        nccl, why = _try(lambda: importlib.import_module("cupy.cuda.nccl"))
        if nccl is not None and not getattr(nccl, "available", False):
            why = "cupy.cuda.nccl.available is False"
        put("NCCL", why is None, why and f"NCCL not usable by CuPy ({why})")
        if why and problem is None:
            wheels.append("nvidia-nccl-cu13")
        # The fast path's plumbing, which the GPU path runs without (each with a note) but then is
        # not the fast path: cuBLASLt through nvmath-python (GEMM epilogues, and the GEMMs inside
        # CUDA graphs), CUPTI (the profiler's device times), NVTX ranges (ncu's and nsys's filters)
        extras = []
        for module, wheel, what in (
                ("nvmath.bindings.cublasLt", "nvmath-python", "no GEMM epilogues, no CUDA graphs"),
                ("cupti.cupti", "cupti-python", "the profiler falls back to CUDA events"),
                ("nvtx", "nvtx", "no NVTX ranges, so ncu/nsys cannot filter by step")):
            mod, why = _try(lambda m=module: importlib.import_module(m))
            if mod is not None and wheel == "nvtx" and not hasattr(mod, "get_domain"):
                mod, why = None, "nvtx older than 0.2.12 (no nvtx.get_domain)"
            if mod is None:
                extras.append(f"{wheel} ({what}: {why})")
                wheels.append(wheel)
                if (wheel == "cupti-python"
                    and _try(lambda: importlib.import_module("elftools"))[0] is None):
                    wheels.append("pyelftools")                 # cupti-python's own dependency
        put("EXTRAS", not extras, extras and "not installed: " + "; ".join(extras))
    else:
        put("CUDA", False, "--device emu: no GPU used")
        put("NCCL", False, "--device emu: no GPU used")
        put("EXTRAS", True)
    torch, why = _try(lambda: importlib.import_module("torch"))
    put("TORCH_CPU", torch is not None, why and f"torch is not installed ({why})")
    if torch is None:
        wheels.append("torch")
        put("TORCH", False, f"torch is not installed ({why})")
    elif device == "cuda" and not torch.cuda.is_available():
        put("TORCH", False, f"torch {torch.__version__} sees no GPU (torch.cuda.is_available() is "
                            "False): a CPU build; bring a CUDA build of torch as a wheel")
    else:
        put("TORCH", True)
    pytest, why = _try(lambda: importlib.import_module("pytest"))
    put("PYTEST", pytest is not None, why and f"pytest is not installed ({why})")
    if pytest is None:
        wheels.append("pytest")
    out["WHEELS_NEEDED"] = " ".join(dict.fromkeys(wheels))
    for key, value in out.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


def loss_falls(log, min_drop):
    """0 when main.log's train losses are finite and the last is at least
    min_drop below the first."""
    losses = []
    with open(log) as f:
        for line in f:
            m = re.match(r"s:(\d+) trl:(\S+)", line)
            if m:
                losses.append((int(m.group(1)), float(m.group(2))))
    if len(losses) < 2:
        print(f"FAIL: {log} has {len(losses)} train loss lines, need 2 or more")
        return 1
    bad = [s for s, v in losses if not np.isfinite(v)]
    (s0, first), (s1, last) = losses[0], losses[-1]
    print(f"train loss: step {s0} {first:.4f} -> step {s1} {last:.4f} (drop {first - last:.4f}, "
          f"{len(losses)} steps; needed a drop of {min_drop})")
    if bad:
        print(f"FAIL: non-finite train loss at steps {bad[:10]}")
        return 1
    if not first - last >= min_drop:
        print("FAIL: the loss did not fall enough")
        return 1
    print("OK: the loss falls")
    return 0


def summary(out):
    """DIR/stages.tsv (stage, status, seconds, reason, log, command per line) -> summary.txt and
    summary.json; prints summary.txt."""
    stages = []
    with open(os.path.join(out, "stages.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 6:
                name, status, secs, reason, log, command = parts[:6]
                stages.append({"stage": name, "status": status, "seconds": float(secs or 0),
                               "reason": reason, "log": log, "command": command})
    counts = {s: sum(st["status"] == s for st in stages) for s in ("PASS", "FAIL", "SKIP")}
    meta = {}
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    result = "FAIL" if counts["FAIL"] else ("PASS" if counts["PASS"] else "NOTHING RAN")
    lines = [f"gpt2np GPU acceptance: {result}  ({counts['PASS']} passed, {counts['FAIL']} failed, "
             f"{counts['SKIP']} skipped)"]
    lines += [f"{k}: {v}" for k, v in meta.items()]
    lines.append("")
    lines.append(f"{'stage':14} {'result':6} {'seconds':>8}  reason / log")
    for st in stages:
        where = st["reason"] or st["log"]
        if st["reason"] and st["log"]:
            where = f"{st['reason']}  [{st['log']}]"
        lines.append(f"{st['stage']:14} {st['status']:6} {st['seconds']:8.1f}  {where}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"result": result, **counts, **{"meta": meta}, "stages": stages}, f, indent=2)
        f.write("\n")
    sys.stdout.write(text)
    return 0


AGREEMENT = re.compile(r"built-in vs ncu kernel times: (\d+) kernels matched, median ratio "
                       r"([0-9.]+), (\d+)% within 10%, step total ratio ([0-9.]+)")


def ncu_agrees(log, tolerance):
    """0 when bench/ncu.sh's log says the built-in kernel times agree with ncu's: the step total and
    the median ratio (built-in / ncu) within `tolerance` of 1 (short kernels differ by ncu's own
    per-kernel overhead, so not each kernel is held to it)."""
    try:
        text = open(log).read()
    except OSError as e:
        print(f"FAIL: {log}: {e.strerror}")
        return 1
    m = AGREEMENT.search(text)
    if not m:
        print(f"FAIL: {log} has no 'built-in vs ncu kernel times' line (the kernels did not match "
              "the built-in profile, or ncu did not finish)")
        return 1
    kernels, median, within, total = (int(m.group(1)), float(m.group(2)), int(m.group(3)),
                                      float(m.group(4)))
    ok = abs(total - 1) <= tolerance and abs(median - 1) <= tolerance
    print(f"{'PASS' if ok else 'FAIL'}: built-in / ncu kernel times over {kernels} kernels: step "
          f"total {total:.3f}, median {median:.3f} (each within {tolerance:g} of 1 to pass); "
          f"{within}% of the kernels within 10%")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("dir")
    s.add_argument("--full", action="store_true")
    s = sub.add_parser("preflight")
    s.add_argument("--device", choices=("cuda", "emu"), default="cuda")
    s = sub.add_parser("loss-falls")
    s.add_argument("log")
    s.add_argument("--min-drop", type=float, default=0.5)
    s = sub.add_parser("ncu-agrees")
    s.add_argument("log")
    s.add_argument("--tolerance", type=float, default=0.10)
    s = sub.add_parser("summary")
    s.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        return setup(args.dir, args.full)
    if args.cmd == "preflight":
        return preflight(args.device)
    if args.cmd == "loss-falls":
        return loss_falls(args.log, args.min_drop)
    if args.cmd == "ncu-agrees":
        return ncu_agrees(args.log, args.tolerance)
    return summary(args.dir)


if __name__ == "__main__":
    sys.exit(main())
