"""Median ms per training step on the CPU: gpt2np against PyTorch's fastest CPU step and the floor.

A step = forward + backward + global-norm clipping (1.0) + AdamW (weight decay 0.1) on d12 (124M)
at B=4, T=64 by default, the same thread count everywhere. In one run, each in its own process:

  gpt2np           gpt2np.train_step.train_step on the numpy backend (the project's one step)
  pytorch eager    the same model math in PyTorch fp32, AdamW(fused=True), clip_grad_norm_(foreach)
  pytorch compile  the same, forward + backward through torch.compile (inductor, C++ on the CPU)
  floor            the step's matmul FLOPs (the op contract's GEMM terms of a recorded gpt2np
                   step) at the GEMM rate measured now on exactly those shapes (best of NumPy's
                   BLAS and PyTorch's), plus the bytes AdamW must move (the contract's adamw term:
                   params, grads, m, v read; params, m, v written) at the memory bandwidth
                   measured now (best of a threaded in-place add in NumPy and in PyTorch)
  floor, cold      the same FLOPs timed as the step meets them: every GEMM of the step on
  operands         operands of its own (each layer's weights are distinct memory, not in cache
                   when their GEMM starts), one after another in the step's order of shapes, best
                   of the rounds (NumPy's BLAS): what the BLAS gives a step that streams 124M
                   weights through the caches

It prints each median (and the range of the steps), gpt2np's ratio to the fastest PyTorch and to
the floor, gpt2np's second step op by op, its peak memory (VmHWM) against params + grads + m + v +
activations, and how busy the machine was otherwise (other processes' CPU from /proc/stat,
hypervisor steal, the load average).

--rounds N runs every part N times, interleaved, so that a slow spell of the machine hits all of
them; the floor keeps the best of everything it measured (a strict floor), the steps their median.
A "round by round" line adds each round's gpt2np median over the floor measured in that round (how
much of the ratio is drift). A "paired" line: after its timed steps the gpt2np process runs --steps
more pairs of steps, each pair followed by the floor measured again in the same process (NumPy's
BLAS, one warm-up and one timed call per shape), and takes the second step of each pair over the
floor right after it (--no-paired skips them): the ratio at the same moment, on a machine whose
speed moves by tens of percent from minute to minute. (A step that follows the floor's measurement
meets caches and TLBs filled with the floor's operands: it is neither paired nor timed.)

    python bench/cpu_step.py [--rounds 1] [--steps 8] [--warmup 2] [-b 4] [-t 64] [--model d12]
                             [--threads N] [--no-torch] [--no-compile] [--no-floor] [--no-paired]
                             [--json FILE]
"""
import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# before NumPy, in this process and (through the environment) in every part's: gpt2np sets
# OpenBLAS's thread timeout, which OpenBLAS reads once, when NumPy loads it (with its default, its
# threads spin after every GEMM and slow gpt2np's step by a few percent; an import sorter must not
# move NumPy above this line)
import gpt2np  # noqa: F401

GEMM_TERMS = {"matmul_forward": ("gemm",), "matmul_backward": ("dinp", "dweight"),
              "attention_forward": ("scores", "weighted_sum"),
              "attention_backward": ("dv", "datt", "dq", "dk")}


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_usage():
    """(wall s, CPU s busy on the whole machine, CPU s of hypervisor steal, CPU s of our
    finished children)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter(), (user + nice + system + irq + softirq) / hz, steal / hz,
            children.ru_utime + children.ru_stime)


def other_cores(before, after):
    """(cores other processes kept busy, cores the hypervisor took) on average
    between two cpu_usage()."""
    wall = after[0] - before[0]
    others = (after[1] - before[1]) - (after[3] - before[3])
    return max(0.0, others / wall), (after[2] - before[2]) / wall


def step_gemms(op, args):
    """The GEMMs one op call runs, as (m, n, k, batch, a_transposed, b_transposed): C (m,n)
    = A (m,k) B (k,n)."""
    if op == "matmul_forward":
        out, inp, weight, bias = args[:4]               # (and `fused`, when the model passes it)
        OC, C = weight.shape
        return [(inp.size // C, OC, C, 1, False, True)]
    if op == "matmul_backward":
        dinp, dweight, dbias, dout, inp, weight = args[:6]
        OC, C = weight.shape
        N = inp.size // C
        return [(N, C, OC, 1, False, False), (OC, C, N, 1, True, False)]
    qkvr = args[1] if op == "attention_forward" else args[2]
    _, B, NH, T, HS = qkvr.shape                         # (3,B,NH,T,HS)
    BH = B * NH
    if op == "attention_forward":
        return [(T, T, HS, BH, False, True), (T, HS, T, BH, False, False)]
    if op == "attention_backward":
        return [(T, HS, T, BH, True, False), (T, T, HS, BH, False, True),
                (T, HS, T, BH, False, False), (T, HS, T, BH, True, False)]
    return []


class Recorder:
    """A ranges listener: the GEMM shapes, GEMM FLOPs (the contract's terms), AdamW bytes and time
    per op of the ops it sees."""

    def __init__(self):
        self.gemms, self.gemm_flops, self.matmul_flops, self.adamw_bytes = {}, 0, 0, 0
        self.op_ms, self._start = {}, None

    def on_push(self, name, detail):
        if detail is None:
            return
        from gpt2np.ops.contract import op_cost
        args_ = detail[1]
        if name in GEMM_TERMS:
            cost = op_cost(name, args_)
            flops = sum(cost.terms[t][0] for t in GEMM_TERMS[name])
            self.gemm_flops += flops
            if name.startswith("matmul"):
                self.matmul_flops += flops
            for shape in step_gemms(name, args_):
                self.gemms[shape] = self.gemms.get(shape, 0) + 1
        elif name == "adamw":
            self.adamw_bytes += op_cost(name, args_, detail[2]).bytes
        # after the bookkeeping: the op's own time only
        self._start = time.perf_counter()

    def on_pop(self, name):
        if self._start is not None:
            self.op_ms[name] = self.op_ms.get(name, 0.0) + (time.perf_counter() - self._start) * 1e3
            self._start = None

    def timed_flops(self):
        """FLOPs of the GEMM shapes recorded (what the floor times): must equal gemm_flops."""
        return sum(2 * m * n * k * batch * count
                   for (m, n, k, batch, _, _), count in self.gemms.items())


def round_ratios(gpt2np_runs, floors_by_library, gemms, adamw_bytes, warmup):
    """[(ratio, step ms, floor ms)] per round: gpt2np's median step of the round over the floor
    measured in that same round (best of the libraries in that round, not of the whole run): how
    much of the ratio is the machine's drift between moments."""
    ratios = []
    for i, run in enumerate(gpt2np_runs):
        measured = [runs[i] for runs in floors_by_library if len(runs) > i]
        if not measured:
            break
        gemm_s = sum(g[6] * min(r["gemm_s"][j] for r in measured) for j, g in enumerate(gemms))
        floor_ms = (gemm_s + adamw_bytes / max(r["bandwidth"] for r in measured)) * 1e3
        step_ms = statistics.median(run["times_ms"][warmup:])
        ratios.append((step_ms / floor_ms, step_ms, floor_ms))
    return ratios


def bench_gpt2np(args):
    import numpy as np

    from gpt2np import ranges
    from gpt2np.backends.numpy.backend import NumpyBackend
    from gpt2np.config import preset
    from gpt2np.model import GPT2
    from gpt2np.tensors import activation_shapes, layout_size
    from gpt2np.train_step import AdamW, train_step

    cfg = preset(args.model)
    model = GPT2(cfg, NumpyBackend(threads=args.threads, math=args.cpu_math), args.b,
                 args.t, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (args.b, args.t)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (args.b, args.t)).astype(np.int32)
    adamw = AdamW(weight_decay=0.1, grad_clip=1.0)

    recorder = Recorder()
    times, paired = [], []
    if args.warmup + args.steps < 2:
        raise SystemExit("need at least 2 steps (warm-up + measured)")

    def timed_step(step):
        t0 = time.perf_counter()
        train_step(model, lambda: (x, y), step=step, lr=1e-4, adamw=adamw)
        return time.perf_counter() - t0

    # the timed steps, back to back as in training
    for step in range(args.warmup + args.steps):
        if step == 1:                                    # the second step: m and v exist already
            ranges.add_listener(recorder)
        times.append(timed_step(step))
        if step == 1:
            ranges.remove_listener(recorder)
    # the step's, before the floor's operands are allocated
    peak = peak_rss_bytes()
    # Paired: --steps more times, a step, a step timed, then the floor measured in this process
    # (seconds apart, so the machine runs at the same speed). The floor's operands and its 2 x 256
    # MiB bandwidth arrays evict the step's memory from caches and TLBs, which slows the step right
    # after them, so the step paired is the second after a floor, and none of these is
    # among the timed steps.
    step = args.warmup + args.steps
    for _ in range(args.steps if args.paired else 0):
        timed_step(step)
        step_s = timed_step(step + 1)
        step += 2
        paired.append([step_s * 1e3, floor_ms(floor_numpy(list(recorder.gemms), args, reps=1),
                                               [[*k, c] for k, c in recorder.gemms.items()],
                                               recorder.adamw_bytes)])
    assert recorder.timed_flops() == recorder.gemm_flops, (recorder.timed_flops(),
                                                           recorder.gemm_flops)
    n = model.num_parameters
    budget = 4 * (4 * n + layout_size(activation_shapes(cfg, args.b, args.t)))
    return {"ms": statistics.median(times[args.warmup:]) * 1e3,
            "times_ms": [t * 1e3 for t in times],
            "peak": peak, "budget": budget, "gemm_flops": recorder.gemm_flops,
            "adamw_bytes": recorder.adamw_bytes,
            "gemms": [[*k, c] for k, c in recorder.gemms.items()], "op_ms": recorder.op_ms,
            "matmul_flops": recorder.matmul_flops, "profiled_step_ms": times[1] * 1e3,
            "paired_floor_ms": paired}


def floor_ms(measured, gemms, adamw_bytes):
    """The floor in ms from one floor measurement ({"gemm_s": per shape, "bandwidth"}) and the
    recorded GEMMs ([m, n, k, batch, ta, tb, count] each, in the measurement's order)."""
    gemm_s = sum(g[6] * measured["gemm_s"][i] for i, g in enumerate(gemms))
    return (gemm_s + adamw_bytes / measured["bandwidth"]) * 1e3


def torch_model(args):
    """(params dict, loss function) of the same GPT-2 in PyTorch: tanh GELU, causal
    attention, tied lm_head."""
    import torch
    import torch.nn.functional as F

    from gpt2np.config import preset
    cfg = preset(args.model)
    C, L, NH = cfg.channels, cfg.num_layers, cfg.num_heads
    g = torch.Generator().manual_seed(0)

    def p(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

    params = {"wte": p(cfg.padded_vocab_size, C), "wpe": p(cfg.max_seq_len, C)}
    for l in range(L):
        params.update({f"{l}.ln1w": torch.nn.Parameter(torch.ones(C)),
                       f"{l}.ln1b": torch.nn.Parameter(torch.zeros(C)), f"{l}.qkvw": p(3 * C, C),
                       f"{l}.qkvb": torch.nn.Parameter(torch.zeros(3 * C)),
                       f"{l}.attprojw": p(C, C),
                       f"{l}.attprojb": torch.nn.Parameter(torch.zeros(C)),
                       f"{l}.ln2w": torch.nn.Parameter(torch.ones(C)),
                       f"{l}.ln2b": torch.nn.Parameter(torch.zeros(C)),
                       f"{l}.fcw": p(4 * C, C), f"{l}.fcb": torch.nn.Parameter(torch.zeros(4 * C)),
                       f"{l}.fcprojw": p(C, 4 * C),
                       f"{l}.fcprojb": torch.nn.Parameter(torch.zeros(C))})
    params["lnfw"] = torch.nn.Parameter(torch.ones(C))
    params["lnfb"] = torch.nn.Parameter(torch.zeros(C))
    B, T = args.b, args.t

    def loss_fn(x, y):
        h = params["wte"][x] + params["wpe"][:T]
        for l in range(L):
            a = F.layer_norm(h, (C,), params[f"{l}.ln1w"], params[f"{l}.ln1b"])
            q, k, v = F.linear(a, params[f"{l}.qkvw"], params[f"{l}.qkvb"]).split(C, dim=-1)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v,
                                                 is_causal=True).transpose(1, 2).reshape(B, T, C)
            h = h + F.linear(att, params[f"{l}.attprojw"], params[f"{l}.attprojb"])
            a = F.layer_norm(h, (C,), params[f"{l}.ln2w"], params[f"{l}.ln2b"])
            f = F.gelu(F.linear(a, params[f"{l}.fcw"], params[f"{l}.fcb"]), approximate="tanh")
            h = h + F.linear(f, params[f"{l}.fcprojw"], params[f"{l}.fcprojb"])
        h = F.layer_norm(h, (C,), params["lnfw"], params["lnfb"])
        logits = F.linear(h, params["wte"][:cfg.vocab_size])
        return F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))

    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return params, loss_fn, x, y


def bench_torch(args, compiled):
    import torch
    torch.set_num_threads(args.threads)
    params, loss_fn, x, y = torch_model(args)
    if compiled:
        loss_fn = torch.compile(loss_fn, dynamic=False)
    decay = [v for v in params.values() if v.dim() == 2]
    no_decay = [v for v in params.values() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0, foreach=True)
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times[args.warmup:]) * 1e3,
            "times_ms": [t * 1e3 for t in times]}


def best_time(fn, reps):
    """The fastest of `reps` timed calls after one untimed (the profiler's CPU roofline times its
    ceilings so too)."""
    from gpt2np.profiling.cpu_roof import best_seconds
    return best_seconds(fn, reps)


def gemm_call(rng, m, n, k, batch, ta, tb):
    """np.matmul on new random operands of one recorded GEMM shape (stored transposed where the
    step's are), as a call with no arguments."""
    import numpy as np
    a = rng.standard_normal((batch, k, m) if ta else (batch, m, k), np.float32)
    b = rng.standard_normal((batch, n, k) if tb else (batch, k, n), np.float32)
    a_, b_ = (a.transpose(0, 2, 1) if ta else a), (b.transpose(0, 2, 1) if tb else b)
    if batch == 1:
        a_, b_ = a_[0], b_[0]
    out = np.empty((batch, m, n) if batch > 1 else (m, n), np.float32)
    return functools.partial(np.matmul, a_, b_, out=out)


def floor_numpy(gemms, args, reps=None):
    """Best seconds per GEMM shape with NumPy's BLAS, and the bandwidth (bytes/s) of a threaded
    in-place add, each the best of `reps` runs (default args.reps) after one untimed."""
    import numpy as np

    from gpt2np.profiling.cpu_roof import add_bandwidth
    rng = np.random.default_rng(0)
    seconds = []
    reps = reps or args.reps
    for shape in gemms:
        seconds.append(best_time(gemm_call(rng, *shape), reps))
    # x += y over the threads
    bandwidth = add_bandwidth(args.threads, reps, args.bandwidth_mb << 20)
    return {"gemm_s": seconds, "bandwidth": bandwidth}


def cold_gemm_seconds(recorded, args):
    """Seconds for all the step's GEMMs ([m, n, k, batch, ta, tb, count] each) on cold operands:
    `count` distinct operand pairs per shape, as the step's layers have, every GEMM run once in
    turn; the best of args.reps passes over the whole set (the set is hundreds of MB, so no GEMM
    finds its operands in cache)."""
    import numpy as np

    rng = np.random.default_rng(1)
    calls = []
    for *shape, count in recorded:
        calls += [gemm_call(rng, *shape) for _ in range(count)]
    # no shape runs twice in a row
    order = [calls[i] for i in np.random.default_rng(2).permutation(len(calls))]

    def everything():
        for call in order:
            call()
    return best_time(everything, max(1, args.reps // 2))


def floor_torch(gemms, args):
    """The same with PyTorch (MKL GEMMs, its own threads)."""
    import torch
    torch.set_num_threads(args.threads)
    seconds = []
    for m, n, k, batch, ta, tb in gemms:
        a = torch.randn((batch, k, m) if ta else (batch, m, k))
        b = torch.randn((batch, n, k) if tb else (batch, k, n))
        a_, b_ = (a.transpose(1, 2) if ta else a), (b.transpose(1, 2) if tb else b)
        if batch == 1:
            a_, b_ = a_[0], b_[0]
        out = torch.empty((batch, m, n) if batch > 1 else (m, n))
        seconds.append(best_time(functools.partial(torch.matmul, a_, b_, out=out), args.reps))
    size = args.bandwidth_mb << 18
    x, y = torch.ones(size), torch.ones(size)
    bandwidth = 12 * size / best_time(lambda: x.add_(y), args.reps)
    return {"gemm_s": seconds, "bandwidth": bandwidth}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--cpu-math", choices=["fast", "exact"], default="fast",
                    help="gpt2np's CPU math, as train.py's --cpu-math (default fast, the "
                         "trainer's default)")
    ap.add_argument("--no-torch", action="store_true",
                    help="gpt2np only (quick A/B of gpt2np changes)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--no-floor", action="store_true", help="skip measuring the floor")
    ap.add_argument("--no-paired", dest="paired", action="store_false",
                    help="skip the paired floor (measured again, with NumPy's BLAS, right after "
                         "each gpt2np step)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, interleaved")
    ap.add_argument("--reps", type=int, default=5,
                    help="repetitions per floor measurement (best is kept)")
    ap.add_argument("--bandwidth-mb", type=int, default=256,
                    help="MiB per array in the bandwidth measurement")
    ap.add_argument("--json", help="also write every measurement to this file")
    ap.add_argument("--only", choices=["gpt2np", "torch-eager", "torch-compile", "floor-numpy",
                                       "floor-torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only:
        if args.only == "gpt2np":
            result = bench_gpt2np(args)
        elif args.only.startswith("torch"):
            result = bench_torch(args, compiled=args.only == "torch-compile")
        else:
            recorded = json.load(sys.stdin)
            gemms = [tuple(g[:6]) for g in recorded]
            result = (floor_numpy if args.only == "floor-numpy" else floor_torch)(gemms, args)
            if args.only == "floor-numpy":
                result["gemm_cold_s"] = cold_gemm_seconds(recorded, args)
        print("RESULT " + json.dumps(result))
        return

    # each part in its own process, so peak memory, thread pools and BLAS libraries do not mix
    base = [sys.executable, __file__, "--model", args.model, "-b", str(args.b), "-t", str(args.t),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads",
            str(args.threads), "--cpu-math", args.cpu_math, "--reps", str(args.reps),
            "--bandwidth-mb", str(args.bandwidth_mb)]
    if not args.paired or args.no_floor:
        base.append("--no-paired")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.threads != len(os.sched_getaffinity(0)):
        # only when asked for fewer threads than cores: pinning OpenBLAS to all cores explicitly
        # made its GEMMs ~7% slower here than its default (which uses all cores already)
        env["OPENBLAS_NUM_THREADS"] = str(args.threads)

    def run(only, stdin=None):
        before = cpu_usage()
        proc = subprocess.run(base + ["--only", only], env=env, input=stdin, capture_output=True,
                              text=True)
        others = other_cores(before, cpu_usage())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"exit {proc.returncode}: {last[:200]}"
        busy.append(others)
        result = json.loads(lines[-1][len("RESULT "):])
        result["other_cores"], result["steal_cores"] = others
        result["wall_s"] = cpu_usage()[0] - before[0]
        return result, None

    busy = []

    report = {"model": args.model, "B": args.b, "T": args.t, "threads": args.threads,
              "cpu_math": args.cpu_math, "steps": args.steps,
              "warmup": args.warmup, "rounds": args.rounds,
              "loadavg_before": open("/proc/loadavg").read().split()[:3]}
    print(f"model {args.model}, B={args.b}, T={args.t}, {args.threads} threads, --cpu-math "
          f"{args.cpu_math}, clip 1.0, AdamW wd 0.1; median "
          f"of {args.steps} steps after {args.warmup} warm-up x {args.rounds} round(s), each in "
          f"its own process; load average {' '.join(report['loadavg_before'])}")
    torch_ok = False
    if not args.no_torch:
        try:
            import torch  # noqa: F401
            torch_ok = True
        except ImportError:
            print("pytorch: not installed (pip install torch): no comparison")
    variants = [("gpt2np", "gpt2np")]
    if torch_ok:
        variants.append(("torch-eager", "pytorch eager + fused AdamW"))
        if not args.no_compile:
            variants.append(("torch-compile", "pytorch compile + fused AdamW"))
    if not args.no_floor:
        variants.append(("floor-numpy", "floor, NumPy's BLAS"))
        if torch_ok:
            variants.append(("floor-torch", "floor, PyTorch's BLAS"))
    runs = {only: [] for only, _ in variants}
    failed = {}
    # rounds interleave the variants, so drift hits all
    for _ in range(args.rounds):
        for only, label in variants:
            if only in failed:
                continue
            # the floor times the GEMM shapes gpt2np's step ran (recorded in its first run)
            stdin = json.dumps(runs["gpt2np"][0]["gemms"]) if only.startswith("floor") else None
            result, err = run(only, stdin)
            if err:
                if only == "gpt2np":
                    sys.exit(f"gpt2np failed: {err}")
                failed[only] = err
                print(f"{label:32s}: failed ({err}); continuing without it")
                continue
            runs[only].append(result)
    floors_by_library = [runs.pop("floor-numpy", []), runs.pop("floor-torch", [])]
    floors = floors_by_library[0] + floors_by_library[1]
    variants = [(only, label) for only, label in variants if not only.startswith("floor")]
    medians, spread = {}, {}
    for only, _ in variants:
        if runs[only]:
            steps = [t for r in runs[only] for t in r["times_ms"][args.warmup:]]
            medians[only], spread[only] = (statistics.median(steps),
                                           f"steps {min(steps):.0f}-{max(steps):.0f}")
            report[only] = {"ms": medians[only], "runs": runs[only]}
    ours = runs["gpt2np"][0]
    ms = medians["gpt2np"]
    print(f"{'gpt2np':32s}: {ms:8.1f} ms/step   ({spread['gpt2np']})   peak RSS "
          f"{ours['peak'] / 2**30:.2f} GiB = {ours['peak'] / ours['budget']:.2f}x "
          f"params+grads+m+v+acts ({ours['budget'] / 2**30:.2f} GiB)")
    op_ms = ours["op_ms"]
    mm = op_ms.get("matmul_forward", 0) + op_ms.get("matmul_backward", 0)
    adam, norm = op_ms.get("adamw", 0), op_ms.get("global_norm", 0)
    rest = sum(op_ms.values()) - mm - adam - norm
    print(f"{'  its 2nd step, op by op':32s}: matmul ops {mm:.0f} ms "
          f"({ours['matmul_flops'] / mm / 1e6:.0f} GFLOP/s), AdamW {adam:.0f} ms "
          f"({ours['adamw_bytes'] / adam / 1e6:.1f} GB/s), grad norm {norm:.0f} ms, other ops "
          f"{rest:.0f} ms, between ops {ours['profiled_step_ms'] - sum(op_ms.values()):.0f} ms")
    fastest = None
    for only, label in variants[1:]:
        if only in medians:
            print(f"{label:32s}: {medians[only]:8.1f} ms/step   ({spread[only]})")
            if fastest is None or medians[only] < fastest[1]:
                fastest = (label, medians[only])
    if fastest:
        report["ratio_to_fastest_torch"] = ms / fastest[1]
        print(f"{'gpt2np / fastest PyTorch':32s}: {ms / fastest[1]:8.2f}x   "
              f"({fastest[0]}; target <= 0.90)")

    if floors:
        # the floor's parts at their best in this run: each GEMM shape's fastest time over the
        # libraries and rounds, the highest bandwidth
        gemms = ours["gemms"]
        gemm_s = sum(g[6] * min(r["gemm_s"][i] for r in floors) for i, g in enumerate(gemms))
        bandwidth = max(r["bandwidth"] for r in floors)
        adamw_s = ours["adamw_bytes"] / bandwidth
        floor_ms = (gemm_s + adamw_s) * 1e3
        report["floor"] = {"gemm_flops": ours["gemm_flops"], "gemm_s": gemm_s,
                           "bandwidth": bandwidth, "adamw_bytes": ours["adamw_bytes"],
                           "adamw_s": adamw_s, "ms": floor_ms, "measurements": floors}
        report["ratio_to_floor"] = ms / floor_ms
        print(f"{'floor':32s}: {floor_ms:8.1f} ms/step = matmuls "
              f"{ours['gemm_flops'] / 1e9:.1f} GFLOP at "
              f"{ours['gemm_flops'] / gemm_s / 1e9:.0f} GFLOP/s ({gemm_s * 1e3:.0f} ms) + AdamW "
              f"{ours['adamw_bytes'] / 1e9:.2f} GB at {bandwidth / 1e9:.1f} GB/s "
              f"({adamw_s * 1e3:.0f} ms)")
        print(f"{'gpt2np / floor':32s}: {ms / floor_ms:8.2f}x   (target <= 1.15)")
        by_round = round_ratios(runs["gpt2np"], floors_by_library, gemms, ours["adamw_bytes"],
                                args.warmup)
        if by_round:
            report["ratio_to_floor_by_round"] = by_round
            print(f"{'  round by round':32s}: "
                  f"{', '.join(f'{r:.2f}x ({s:.0f}/{f:.0f})' for r, s, f in by_round)}   (each "
                  "round's gpt2np median / the floor measured in that round, ms)")
        pairs = [(t, f) for r in runs["gpt2np"] for t, f in r["paired_floor_ms"]]
        if pairs:
            ratios = sorted(t / f for t, f in pairs)
            report["ratio_to_floor_paired"] = {"median": statistics.median(ratios), "pairs": pairs}
            print(f"{'  paired, step by step':32s}: {statistics.median(ratios):8.2f}x   (median of "
                  f"{len(ratios)} steps, each over the floor measured right after it with NumPy's "
                  f"BLAS; {ratios[0]:.2f}x-{ratios[-1]:.2f}x)")
        cold = [r["gemm_cold_s"] for r in floors if "gemm_cold_s" in r]
        if cold:
            cold_ms = (min(cold) + adamw_s) * 1e3
            report["floor_cold"] = {"gemm_s": min(cold), "ms": cold_ms}
            report["ratio_to_floor_cold"] = ms / cold_ms
            print(f"{'floor, cold operands':32s}: {cold_ms:8.1f} ms/step = matmuls at "
                  f"{ours['gemm_flops'] / min(cold) / 1e9:.0f} GFLOP/s ({min(cold) * 1e3:.0f} ms), "
                  "each GEMM on its own operands as in the step + AdamW")
            print(f"{'gpt2np / cold-operand floor':32s}: {ms / cold_ms:8.2f}x")
    report["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    other, steal = max(b[0] for b in busy), max(b[1] for b in busy)
    report["max_other_cores"], report["max_steal_cores"] = other, steal
    print(f"other processes kept {other:.2f} cores busy on average during the busiest part, the "
          f"hypervisor took {steal:.2f}; load average now {' '.join(report['loadavg_after'])}"
          + ("  (NOISY: compare runs taken on a quiet machine only)" if other > 0.1 or steal > 0.1
             else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
