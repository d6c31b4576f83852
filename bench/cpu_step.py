"""Median ms per training step on the CPU: gpt2np (numpy backend) vs an equivalent PyTorch fp32 eager step.

A step = forward + backward + global-norm clipping + AdamW on d12 (124M) at B=4, T=64 by default, same
thread count for both. Also reports peak memory (VmHWM) against params + grads + m + v + activations.

    python bench/cpu_step.py [--steps 6] [--warmup 2] [-b 4] [-t 64] [--model d12] [--threads N] [--no-torch]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def bench_gpt2np(args):
    import numpy as np

    import gpt2np  # noqa: F401  (first: it sets OpenBLAS's thread timeout before NumPy loads OpenBLAS)
    from gpt2np.backends.numpy_backend import NumpyBackend
    from gpt2np.config import preset
    from gpt2np.model import GPT2
    from gpt2np.tensors import activation_shapes, layout_size
    from gpt2np.train_step import AdamW, train_step

    cfg = preset(args.model)
    model = GPT2(cfg, NumpyBackend(threads=args.threads), args.b, args.t, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (args.b, args.t)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (args.b, args.t)).astype(np.int32)
    adamw = AdamW(weight_decay=0.1)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        train_step(model, lambda: (x, y), step=step, lr=1e-4, adamw=adamw)
        times.append(time.perf_counter() - t0)
    n = model.num_parameters
    budget = 4 * (4 * n + layout_size(activation_shapes(cfg, args.b, args.t)))
    return statistics.median(times[args.warmup:]) * 1e3, peak_rss_bytes(), budget


def bench_torch(args):
    import torch
    import torch.nn.functional as F

    from gpt2np.config import preset
    torch.set_num_threads(args.threads)
    cfg = preset(args.model)
    C, L, NH = cfg.channels, cfg.num_layers, cfg.num_heads
    g = torch.Generator().manual_seed(0)

    def p(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

    params = {"wte": p(cfg.padded_vocab_size, C), "wpe": p(cfg.max_seq_len, C)}
    for l in range(L):
        params.update({f"{l}.ln1w": torch.nn.Parameter(torch.ones(C)), f"{l}.ln1b": torch.nn.Parameter(torch.zeros(C)),
                       f"{l}.qkvw": p(3 * C, C), f"{l}.qkvb": torch.nn.Parameter(torch.zeros(3 * C)),
                       f"{l}.attprojw": p(C, C), f"{l}.attprojb": torch.nn.Parameter(torch.zeros(C)),
                       f"{l}.ln2w": torch.nn.Parameter(torch.ones(C)), f"{l}.ln2b": torch.nn.Parameter(torch.zeros(C)),
                       f"{l}.fcw": p(4 * C, C), f"{l}.fcb": torch.nn.Parameter(torch.zeros(4 * C)),
                       f"{l}.fcprojw": p(C, 4 * C), f"{l}.fcprojb": torch.nn.Parameter(torch.zeros(C))})
    params["lnfw"] = torch.nn.Parameter(torch.ones(C))
    params["lnfb"] = torch.nn.Parameter(torch.zeros(C))
    B, T = args.b, args.t

    def forward(x, y):
        h = params["wte"][x] + params["wpe"][:T]
        for l in range(L):
            a = F.layer_norm(h, (C,), params[f"{l}.ln1w"], params[f"{l}.ln1b"])
            q, k, v = F.linear(a, params[f"{l}.qkvw"], params[f"{l}.qkvb"]).split(C, dim=-1)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            h = h + F.linear(att, params[f"{l}.attprojw"], params[f"{l}.attprojb"])
            a = F.layer_norm(h, (C,), params[f"{l}.ln2w"], params[f"{l}.ln2b"])
            f = F.gelu(F.linear(a, params[f"{l}.fcw"], params[f"{l}.fcb"]), approximate="tanh")
            h = h + F.linear(f, params[f"{l}.fcprojw"], params[f"{l}.fcprojb"])
        h = F.layer_norm(h, (C,), params["lnfw"], params["lnfb"])
        logits = F.linear(h, params["wte"][:cfg.vocab_size])
        return F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))

    decay = [v for k, v in params.items() if v.dim() == 2]
    no_decay = [v for k, v in params.items() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[args.warmup:]) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--only", choices=["gpt2np", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only == "gpt2np":
        ms, peak, budget = bench_gpt2np(args)
        print(f"{ms} {peak} {budget}")
        return
    if args.only == "torch":
        print(bench_torch(args))
        return
    # each side in its own process, so peak memory and thread pools do not mix
    base = [sys.executable, __file__, "--model", args.model, "-b", str(args.b), "-t", str(args.t),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.threads != len(os.sched_getaffinity(0)):
        # only when asked for fewer threads than cores: pinning OpenBLAS to all cores explicitly made
        # its GEMMs ~7% slower here than its default (which uses all cores already)
        env["OPENBLAS_NUM_THREADS"] = str(args.threads)
    ms, peak, budget = map(float, subprocess.check_output(base + ["--only", "gpt2np"], env=env).split())
    print(f"model {args.model}, B={args.b}, T={args.t}, {args.threads} threads, median of {args.steps} steps")
    print(f"gpt2np  : {ms:9.1f} ms/step   peak RSS {peak / 2**30:.2f} GiB = {peak / budget:.2f}x "
          f"(params+grads+m+v+acts = {budget / 2**30:.2f} GiB)")
    if args.no_torch:
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch  : not installed (pip install torch) - no comparison")
        return
    tms = float(subprocess.check_output(base + ["--only", "torch"], env=env))
    print(f"pytorch : {tms:9.1f} ms/step   (fp32 eager, AdamW, same threads)")
    print(f"ratio   : {ms / tms:9.2f}x PyTorch's time (target <= 0.80)")


if __name__ == "__main__":
    main()
