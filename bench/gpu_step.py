"""GPU training-step benchmark: ms/step, tokens/s, MFU and per-kernel times of the CUDA backend.

A step = forward (with dlogits) + backward + global-norm clipping + AdamW (gpt2np's train_step, the
trainer's), on random tokens, d12 (124M) at B=4, T=1024 by default, on the fast path by default:
--precision tf32 (fp32, bf16: llm.c's mixed precision, the kernels' bf16 build), --attention flash,
--fuse 1 (GEMM epilogues, fused residual+LayerNorm), --cuda-graphs 1 (each timed step one graph
launch). Step time is measured with CUDA events over --steps steps after --warmup steps. MFU =
flops_per_token (6N + 6LCT, llm.c's estimate) * tokens/s / the device's peak: the peak of the GEMM
precision in use and, as llm.c reports it, the TF32 (bf16 runs: the bf16) peak. Peak device memory
(CuPy's pool high-water mark) is printed beside it. Then one more step runs eagerly under the
built-in profiler (CUPTI's kernel times where cupti-python is installed) for the per-kernel table.

Last, PyTorch trains the same model on the same GPU, B and T (--torch eager,compile; none: off):
GPT-2 with tanh GELU, tied wte/lm_head over the padded vocabulary, causal attention by
F.scaled_dot_product_attention (--torch-attention manual: the materialized softmax, as gpt2np does
it), global-norm clipping at 1.0 and fused AdamW (weight decay 0.1 on the 2-D tensors), TF32 matmuls
exactly when gpt2np's GEMMs use them (set_float32_matmul_precision "high" / "highest"), bf16 runs
under torch.autocast(bfloat16) (PyTorch's bf16 mixed precision, fp32 weights), in eager mode and
under torch.compile; it prints ms/step for each and gpt2np's ratio to the fastest. With --runtime
emu the PyTorch side runs eager on the CPU (says so; its time is not comparable) and
torch.compile is skipped.

    python bench/gpu_step.py [--model d12] [-b 4] [-t 1024] [--steps 10] [--warmup 3]
                             [--precision tf32|fp32|bf16] [--attention flash|naive] [--fuse 1|0]
                             [-ge 0|1|2] [-r 0|1|2] [--cuda-graphs 1|0] [--top 25]
    python bench/gpu_step.py --runtime emu --model tiny -t 16 --steps 1 --warmup 0  # dry run
"""
import argparse
import sys
from collections import defaultdict

import numpy as np

from gpt2np.backends import get_backend
from gpt2np.config import GPT2Config, preset
from gpt2np.model import GPT2
from gpt2np.profiling.gpu_specs import flops_per_token, lookup, mfu
from gpt2np.profiling.profiler import Profiler
from gpt2np.train_step import AdamW, train_step

ADAMW = AdamW(weight_decay=0.1)
# the tiny model (--model tiny, dry runs on the emulator) has head size 64, so flash
# attention runs on it too
TINY = GPT2Config(max_seq_len=64, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                  channels=128)


def make_backend(args):
    """The CUDA backend on CuPy (or the emulator) at --precision: bf16 picks the
    kernels' bf16 build."""
    return get_backend("emu" if args.runtime == "emu" else "cuda", precision=args.precision)


def run_step(model, x, y, step, graphs=False):
    """One training step (gpt2np's train_step): lr 3e-4, weight decay 0.1, clipping at 1.0; with
    `graphs`, captured once and replayed as a CUDA graph."""
    train_step(model, lambda: (x, y), step=step, lr=3e-4, adamw=ADAMW, cuda_graphs=graphs)


def time_steps(model, be, x, y, first_step, steps, graphs):
    """Mean milliseconds per step over `steps` steps, by CUDA events around the whole run."""
    start, end = be.event(), be.event()
    be.synchronize()
    start.record()
    for i in range(steps):
        run_step(model, x, y, first_step + i, graphs)
    end.record()
    return be.elapsed_ms(start, end) / steps


def peak_memory(be):
    """Bytes of device memory held at the high-water mark (CuPy's pool total), or
    None on the emulator."""
    pool = getattr(getattr(be.rt, "cp", None), "get_default_memory_pool", None)
    return None if pool is None else pool().total_bytes()


def kernel_times(model, be, x, y, step):
    """One step under the built-in profiler -> {kernel: [kind, calls, ms, flops, bytes]} (FLOPs and
    bytes from the op contract's cost formulas, split over each op's kernels)."""
    with Profiler(be) as prof:
        run_step(model, x, y, step)
    table = defaultdict(lambda: [None, 0, 0.0, 0, 0])
    for r in prof.records:
        row = table[r.kernel]
        row[0] = "gemm" if r.is_gemm else "kernel"
        row[1] += 1
        row[2] += r.duration_ns / 1e6
        row[3] += r.flops
        row[4] += r.bytes
    return dict(table)


def print_kernel_table(table, step_ms, top):
    total = sum(row[2] for row in table.values())
    print(f"\nper-kernel times, one step ({len(table)} kernels, "
          f"{sum(r[1] for r in table.values())} launches, "
          f"{total:.2f} ms inside launches of a {step_ms:.2f} ms step)")
    print(f"{'kernel':34} {'kind':6} {'calls':>5} {'ms':>9} {'%':>6} {'GFLOP/s':>9} {'GB/s':>8}")
    rows = sorted(table.items(), key=lambda item: -item[1][2])
    for name, (kind, calls, ms, flops, nbytes) in rows[:top]:
        secs = ms / 1e3
        gflops = flops / secs / 1e9 if secs > 0 else float("nan")
        gbps = nbytes / secs / 1e9 if secs > 0 else float("nan")
        print(f"{name:34} {kind:6} {calls:5d} {ms:9.3f} {100 * ms / total:6.1f} "
              f"{gflops:9.1f} {gbps:8.1f}")
    if len(rows) > top:
        rest = sum(row[2] for _, row in rows[top:])
        print(f"{'(' + str(len(rows) - top) + ' more)':34} {'':6} {'':5} {rest:9.3f} "
              f"{100 * rest / total:6.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="d12", help="preset (d12, d24, d36, d48) or 'tiny'")
    parser.add_argument("-b", type=int, default=4, help="batch size B")
    parser.add_argument("-t", type=int, default=1024, help="sequence length T")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (compile, cuBLAS heuristics)")
    parser.add_argument("--precision", choices=("tf32", "fp32", "bf16"), default=None,
                        help="tf32 (default): TF32 tensor cores for the fp32 GEMMs; fp32: exact; "
                             "bf16: llm.c's mixed precision (bf16 storage and tensor cores, "
                             "fp32 master weights)")
    parser.add_argument("--tf32", action="store_true", help="the same as --precision tf32")
    parser.add_argument("--attention", choices=("flash", "naive"), default="flash",
                        help="flash (default; head size 64, sm_80+) or naive (the (T,T) "
                             "probabilities kept)")
    parser.add_argument("--fuse", type=int, choices=(0, 1), default=1,
                        help="1 (default): the fused ops")
    parser.add_argument("-ge", "--gelu-fusion", dest="gelu_fusion",
                        type=int, choices=(0, 1, 2), default=None,
                        help="with --fuse 1, train.py's -ge: GELU in the fc GEMM's epilogue, 0 "
                             "none, 1 forward, 2 forward and backward (default 2 with --fuse 1)")
    parser.add_argument("-r", "--recompute", type=int, choices=(0, 1, 2), default=0,
                        help="train.py's -r: 0 (default) keep every activation, 1 recompute the "
                             "GELU in backward, 2 also the LayerNorms")
    parser.add_argument("--cuda-graphs", type=int, choices=(0, 1), default=1,
                        help="1 (default): the timed steps replay a captured CUDA graph")
    parser.add_argument("--top", type=int, default=25, help="rows of the per-kernel table")
    parser.add_argument("--runtime", choices=("cupy", "emu"), default="cupy",
                        help="emu: CPU emulator dry run")
    parser.add_argument("--torch", default="eager,compile",
                        help="PyTorch runs to compare with, comma-separated: eager, compile; "
                             "none: no PyTorch")
    parser.add_argument("--torch-attention", choices=("sdpa", "manual"), default="sdpa",
                        help="PyTorch's attention: F.scaled_dot_product_attention, or the "
                             "materialized softmax")
    args = parser.parse_args(argv)
    if args.tf32 and args.precision not in (None, "tf32"):
        parser.error(f"--tf32 with --precision {args.precision}: give one of them")
    args.precision = args.precision or "tf32"
    bad = set(args.torch.split(",")) - {"eager", "compile", "none", ""}
    if bad:
        parser.error(f"--torch {args.torch}: unknown {', '.join(sorted(bad))} (eager, "
                     "compile or none)")
    if args.gelu_fusion and not args.fuse:
        parser.error(f"-ge {args.gelu_fusion} with --fuse 0: the GELU epilogues are fused "
                     "GEMMs (give -ge 0)")

    cfg = TINY if args.model == "tiny" else preset(args.model)
    if not 0 < args.t <= cfg.max_seq_len:
        parser.error(f"-t {args.t} must be in 1..{cfg.max_seq_len}")
    be = make_backend(args)
    device = be.device_name()
    B, T = args.b, args.t
    if args.attention == "flash" and cfg.channels // cfg.num_heads != 64:
        parser.error(f"--attention flash needs head size 64; --model {args.model} has "
                     f"{cfg.channels // cfg.num_heads} (use --attention naive)")
    model = GPT2(cfg, be, B, T, seed=0, attention=args.attention, fuse=bool(args.fuse),
                 gelu_fusion=args.gelu_fusion, recompute=args.recompute)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    graphs = bool(args.cuda_graphs)
    # with graphs: the capture is a warm-up step
    for step in range(max(args.warmup, 2 if graphs else 0)):
        run_step(model, x, y, step, graphs)
    warm = max(args.warmup, 2 if graphs else 0)
    step_ms = time_steps(model, be, x, y, warm, max(1, args.steps), graphs)
    peak = peak_memory(be)
    tokens_per_s = B * T / (step_ms / 1e3)
    fpt = flops_per_token(model.num_parameters, cfg.num_layers, cfg.channels, T)
    precision = be.precision
    spec = lookup(device)
    mfu_used = mfu(fpt, tokens_per_s, device, precision)
    convention = "bf16" if precision == "bf16" else "tf32"
    mfu_llmc = mfu(fpt, tokens_per_s, device, convention)

    print(f"device: {device} ({spec.name if spec else 'no peak numbers known'}), runtime "
          f"{be.rt.name}, precision {precision}, attention {args.attention}, fuse {args.fuse}, "
          f"gelu_fusion {model.gelu_fusion}, "
          f"recompute {model.recompute}, cuda graphs {args.cuda_graphs}")
    print(f"model: {args.model} ({model.num_parameters / 1e6:.2f}M parameters), B={B}, T={T}, "
          f"{args.steps} timed steps after {warm} warmup")
    print(f"step: {step_ms:.2f} ms, {tokens_per_s:,.0f} tokens/s, {fpt * tokens_per_s / 1e12:.2f} "
          f"TFLOP/s ({fpt / 1e6:.1f} MFLOP/token)"
          + (f", peak memory {peak / 2 ** 30:.2f} GiB" if peak is not None else ""))

    def fmt(value):
        return "n/a" if value is None else f"{100 * value:.1f}%"

    print(f"MFU: {fmt(mfu_used)} of the {precision} peak, {fmt(mfu_llmc)} of the {convention} peak "
          "(llm.c's convention)")

    table = kernel_times(model, be, x, y, warm + args.steps)
    print_kernel_table(table, step_ms, args.top)

    modes = [m for m in args.torch.split(",") if m and m != "none"]
    if modes:
        print()
        if torch_comparison(cfg, x, y, step_ms, modes, precision, args):
            return 1                                  # a PyTorch run failed (its line says why)
    return 0


# --------------------------------------------------------------------------------------------------
# PyTorch on the same GPU: the same model, B and T

def torch_gpt2(cfg, attention="sdpa"):
    """A PyTorch GPT-2 module with gpt2np's math: learned positions, pre-LN blocks, tanh GELU, tied
    lm_head over the padded vocabulary Vp (as llm.c's matmul; targets are < V)."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    C, NH = cfg.channels, cfg.num_heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def attn(self, h):
            B, T, _ = h.shape
            q, k, v = self.c_attn(h).split(C, dim=2)
            q, k, v = (a.view(B, T, NH, C // NH).transpose(1, 2) for a in (q, k, v))
            if attention == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))
                mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
                o = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
            return self.attn_proj(o.transpose(1, 2).contiguous().view(B, T, C))

        def forward(self, h):
            h = h + self.attn(self.ln_1(h))
            return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.padded_vocab_size, C)
            self.wpe = nn.Embedding(cfg.max_seq_len, C)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(C)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx, targets):
            T = idx.shape[1]
            h = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for block in self.blocks:
                h = block(h)
            logits = F.linear(self.ln_f(h), self.wte.weight)
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))

    return GPT()


def torch_time(cfg, xt, yt, mode, on_gpu, args):
    """(ms per step, last loss) of PyTorch training the model: --warmup steps (torch.compile
    compiles in the first), then --steps timed by CUDA events (on the CPU: wall clock)."""
    import time

    import torch
    torch.manual_seed(0)
    model = torch_gpt2(cfg, args.torch_attention).to(xt.device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if on_gpu else {}))
    fwd = torch.compile(model) if mode == "compile" else model

    def step():
        with torch.autocast(xt.device.type, dtype=torch.bfloat16,
                            enabled=getattr(args, "autocast", False)):
            loss = fwd(xt, yt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(max(1, args.warmup)):
        loss = step()
    steps = max(1, args.steps)
    if on_gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            loss = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps, float(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    return (time.perf_counter() - t0) * 1e3 / steps, float(loss)


def torch_comparison(cfg, x, y, gpt2np_ms, modes, precision, args):
    """PyTorch eager / torch.compile ms/step on the same GPU, and gpt2np's ratio to the fastest.
    Returns the number of PyTorch runs that failed (no torch, or a torch without a GPU: a
    note, not a failure)."""
    try:
        import torch
    except ImportError as e:
        print(f"PyTorch: skipped, torch is not installed ({e}): pip install torch (a CUDA build)")
        return 0
    on_gpu = args.runtime != "emu"
    if on_gpu and not torch.cuda.is_available():
        print(f"PyTorch: skipped, torch {torch.__version__} sees no GPU (torch.cuda.is_available() "
              "is False: a CPU build, or no CUDA driver for it): bring a CUDA build of torch")
        return 0
    device = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:
        print("PyTorch: --runtime emu, so PyTorch runs eager on the CPU (a dry run of this code, "
              "its time is not comparable); torch.compile skipped")
        modes = [m for m in modes if m == "eager"]
    tf32 = precision == "tf32"
    args.autocast = precision == "bf16"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"PyTorch {torch.__version__} on {name}: same model, B={x.shape[0]}, T={x.shape[1]}, "
          f"matmuls {'bf16 autocast' if args.autocast else 'tf32' if tf32 else 'fp32'}, attention "
          f"{args.torch_attention}, {'fused ' if on_gpu else ''}AdamW, clipping 1.0")
    xt = torch.from_numpy(x.astype(np.int64)).to(device)
    yt = torch.from_numpy(y.astype(np.int64)).to(device)
    results, failed = {}, 0
    for mode in modes:
        try:
            ms, loss = torch_time(cfg, xt, yt, mode, on_gpu, args)
        except Exception as e:                              # e.g. no compiler for torch.compile
            print(f"PyTorch {mode}: failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
            failed += 1
            continue
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
        results[mode] = ms
        label = "torch.compile" if mode == "compile" else "eager"
        print(f"PyTorch {label:13}: {ms:9.2f} ms/step, {x.size / (ms / 1e3):12,.0f} tokens/s "
              f"(loss {loss:.4f})")
    if results:
        best = min(results, key=results.get)
        ratio = gpt2np_ms / results[best]
        label = "torch.compile" if best == "compile" else "eager"
        verdict = (f"{ratio:.2f}x slower than PyTorch" if ratio >= 1
                   else f"{1 / ratio:.2f}x faster than PyTorch")
        note = "" if on_gpu else " (PyTorch on the CPU, gpt2np on the emulator: not comparable)"
        print(f"gpt2np {gpt2np_ms:.2f} ms/step vs PyTorch {label} {results[best]:.2f} ms/step: "
              f"ratio {ratio:.2f} (gpt2np is {verdict}){note}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
