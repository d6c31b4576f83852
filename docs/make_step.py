"""Print docs/step.md, "One training step, op by op":  python docs/make_step.py > docs/step.md

Everything on the page comes from the code, so it cannot drift. The roofline planner
(gpt2np.profiling.plan.plan_step) runs the real GPT2 and train_step for d12 at B=4, T=1024 on the
CUDA backend over a runtime that does no work. That gives the ops in the order a GPU runs them,
their shapes, their kernels, and the op contract's FLOPs and minimum bytes
(gpt2np/ops/contract.py). The floor of a launch on the H100 is max(FLOPs / peak, bytes /
bandwidth). The measured H100 figures come from step_h100.json beside this script.
tests/test_docs.py fails when docs/step.md differs from this
script's output. Runs on the CPU in about a second; no GPU needed.
"""
import importlib
import json
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpt2np.backends.cuda.backend import KERNELS
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import preset
from gpt2np.ops import reference
from gpt2np.ops.contract import OP_METHODS
from gpt2np.profiling.plan import direction_rows, plan_step

MODEL, B, T, GPU = "d12", 4, 1024, "H100"
PRECISIONS = ("tf32", "bf16")
DOCS = Path(__file__).resolve().parent
MEASURED = DOCS / "step_h100.json"
SECTIONS = (("fprop", "Forward"), ("bprop", "Backward"),
            ("update", "Optimizer: grad norm and AdamW"))

# One line per op: what it computes. Shapes: B batch, T time, C channels, OC output channels,
# NH heads, HS = C / NH, V vocabulary, Vp padded vocabulary. An op the model runs without a line
# here stops the script, so the page cannot leave one out.
EQUATIONS = {
    "encoder_forward": "out (B,T,C) = wte (Vp,C)[inp] + wpe (maxT,C)[:T]",
    "layernorm_forward": "out = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + 1e-5), per row",
    "fused_residual_layernorm_forward": "r = a + b; out = layernorm(r); r is the residual stream",
    "matmul_forward": "out (B,T,OC) = inp (B,T,C) @ W (OC,C)^T + bias (OC)",
    "matmul_gelu_forward": "pre = inp @ W^T + bias; out = gelu(pre) (GELU in the GEMM's epilogue)",
    "attention_forward": "att = softmax(q k^T / sqrt(HS), causal); out = att @ v, per head",
    "flash_attention_forward": "out = softmax(q k^T / sqrt(HS), causal) @ v, per head; "
                               "lse = logsumexp of each score row",
    "gelu_forward": "out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
    "residual_forward": "out = a + b",
    "fused_classifier": "loss = logsumexp(logits[:V]) - logits[y]; "
                        "dlogits = (softmax - onehot(y)) / (B T), in place",
    "loss_mean": "stats[0] = mean(loss): the step's loss stays on the device",
    "matmul_backward": "dinp = dout @ W; dW += dout^T @ inp; dbias += sum(dout)",
    "gelu_matmul_backward": "dinp = (dout @ W) * gelu'(pre); dW += dout^T @ inp; "
                            "dbias += sum(dout)",
    "layernorm_backward": "g = w dout; dinp += rstd (g - mean(g) - xhat mean(g xhat)); "
                          "dw += sum(dout xhat); db += sum(dout)",
    "attention_backward": "datt = dout v^T; ds = att (datt - rowsum(datt att)); "
                          "dq = ds k / sqrt(HS); dk = ds^T q / sqrt(HS); dv = att^T dout",
    "flash_attention_backward": "P = exp(q k^T / sqrt(HS) - lse); D = rowsum(dout out); "
                                "ds = P (dout v^T - D); dq = ds k / sqrt(HS); "
                                "dk = ds^T q / sqrt(HS); dv = P^T dout",
    "gelu_backward": "dinp = dout * gelu'(x)",
    "residual_backward": "da += dout; db += dout",
    "encoder_backward": "dwte[inp[b,t]] += dout[b,t]; dwpe[t] += sum over b of dout[b,t]",
    "global_norm": "n2 = sum(g^2) over all gradients; g is scaled by min(1, clip / sqrt(n2))",
    "adamw": "m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; "
             "p -= lr (mhat / (sqrt(vhat) + eps) + wd p)",
}
# Fused ops equal a sequence of reference functions (the op contract says so; the numpy backend
# runs them that way).
REFERENCE_SEQUENCES = {
    "fused_residual_layernorm_forward": ("residual_forward", "layernorm_forward"),
    "matmul_gelu_forward": ("matmul_forward", "gelu_forward"),
    "gelu_matmul_backward": ("matmul_backward", "gelu_backward"),
}


@dataclass
class Row:
    """The calls of one op on one module pattern (h.*.attn.c_attn) in one direction, in step
    order."""
    direction: str
    module: str
    op: str
    layers: set = field(default_factory=set)
    calls: set = field(default_factory=set)
    params: list = field(default_factory=list)
    kernels: dict = field(default_factory=dict)     # kernel -> its term, in launch order
    flops: int = 0
    bytes: int = 0
    floor_ns: dict = field(default_factory=dict)    # precision -> floor of all calls
    bound: str = ""

    @property
    def key(self):
        return self.direction, self.module, self.op


def layer_of(module):
    """(module pattern, layer) of a module path: ('h.*.attn', 3) for 'h.3.attn'."""
    found = re.match(r"h\.(\d+)\.", module)
    return (module, None) if found is None else ("h.*." + module[found.end():], int(found[1]))


def plan_rows(plan, precision, rows, copies):
    """Add `plan`'s launches into rows {key: Row} (ops) and copies {kind: [n, bytes, floor_ns]}."""
    compute = {}
    for x in plan.launches:
        r = x.record
        if not r.op:
            n_bytes_floor = copies.setdefault((r.direction, r.kernel), {})
            n, nbytes, floor = n_bytes_floor.get(precision, (0, 0, 0.0))
            n_bytes_floor[precision] = (n + 1, nbytes + r.bytes, floor + (x.floor_ns or 0.0))
            continue
        module, layer = layer_of(r.module)
        row = rows.setdefault((r.direction, module, r.op), Row(r.direction, module, r.op))
        row.floor_ns[precision] = row.floor_ns.get(precision, 0.0) + (x.floor_ns or 0.0)
        suffix = "" if precision == PRECISIONS[0] else f" ({precision})"
        if r.kernel.startswith("cublas"):
            row.kernels.setdefault(f"cublas {x.term}", suffix)
        else:
            row.kernels.setdefault(r.kernel, suffix)
        if precision != PRECISIONS[0]:
            continue
        if layer is not None:
            row.layers.add(layer)
        if r.range_ids not in row.calls:
            row.calls.add(r.range_ids)
            row.params.append(r.params)
        row.flops += r.flops
        row.bytes += r.bytes
        if x.bound == "compute":
            compute[row.key] = compute.get(row.key, 0.0) + x.floor_ns
    for key, row in rows.items():
        if precision == PRECISIONS[0]:
            share = compute.get(key, 0.0)
            total = row.floor_ns[precision]
            row.bound = ("-" if not total else "compute" if share >= total else
                         "memory" if share == 0 else "mixed")


def plans():
    """{precision: Plan} of the step on the H100."""
    return {p: plan_step(preset(MODEL), B, T, gpu=GPU, precision=p, model_name=MODEL)
            for p in PRECISIONS}


def step_rows(planned):
    """(rows in step order, copies) of both precisions' plans; the same ops in both, or an error."""
    rows, copies = {}, {}
    for precision, plan in planned.items():
        before = set(rows)
        plan_rows(plan, precision, rows, copies)
        if before and set(rows) != before:
            raise AssertionError(f"the {precision} plan runs other ops: {set(rows) ^ before}")
    missing = sorted({row.op for row in rows.values()} - set(EQUATIONS))
    if missing:
        raise KeyError(f"no equation for {missing}: add one to EQUATIONS")
    return list(rows.values()), copies


# ---------------------------------------------------------------------------------------------
# links


def reference_functions():
    """{function name: module file name} of gpt2np/ops/reference/*.py."""
    found = {}
    for info in pkgutil.iter_modules(reference.__path__):
        module = importlib.import_module(f"{reference.__name__}.{info.name}")
        for name, value in vars(module).items():
            if callable(value) and getattr(value, "__module__", None) == module.__name__:
                found[name] = info.name
    return found


def reference_link(op, functions):
    """Markdown links to the NumPy reference functions that compute `op`."""
    names = REFERENCE_SEQUENCES.get(op) or OP_METHODS.get(op, (op,))[:1]
    links = [f"[`{name}`](../gpt2np/ops/reference/{functions[name]}.py)"
             for name in names if name in functions]
    if links:
        return " + ".join(links)
    if hasattr(NumpyBackend, op):                   # an op only the numpy backend has
        return f"[`NumpyBackend.{op}`](../gpt2np/backends/numpy/backend.py)"
    raise KeyError(f"{op}: no reference function and no NumpyBackend method")


def kernel_links(row):
    """The row's kernels: links into kernels/*.cu, cuBLAS GEMMs by their cost term."""
    out = []
    for kernel, suffix in row.kernels.items():
        if kernel.startswith("cublas "):
            out.append(f"cuBLAS {kernel.split()[1]}{suffix}")
        else:
            out.append(f"[`{kernel}`](../kernels/{KERNELS[kernel]}.cu){suffix}")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# text


def calls_text(row):
    """x12 for every layer, x11 (layers 1-11), or the number of calls outside the layers."""
    if not row.layers:
        return str(len(row.calls))
    layers = sorted(row.layers)
    if len(layers) == 1:
        return f"x1 (layer {layers[0]})"
    if len(layers) == 12 and len(row.calls) == 12:
        return "x12"
    return f"x{len(row.calls)} (layers {layers[0]}-{layers[-1]})"


def shapes_text(row):
    """The shapes of its calls (the contract's names); M, N, K of a GEMM left out (B T, OC, C)."""
    shapes = sorted(set(row.params))
    if len(shapes) == 1:
        gemm = "OC=" in shapes[0]
        return ", ".join(p for p in shapes[0].split(",") if not (gemm and p[0] in "MNK"))
    sizes = [int(p[2:]) for p in row.params if re.fullmatch(r"N=\d+", p)]
    if len(sizes) == len(row.params):
        return f"N={sum(sizes):,} in {len(sizes)} tensors"
    return "; ".join(shapes)


def uniform(row):
    """Whether every call of the row has the same shapes (so a call's cost is the total / calls)."""
    return len(set(row.params)) == 1


def what_table(rows, functions, first):
    """The rows' equations, shapes and code, numbered from `first`."""
    lines = ["| # | op | module | calls | equation | shapes | NumPy reference | CUDA kernels |",
             "|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows, first):
        lines.append(f"| {i} | `{row.op}` | `{row.module}` | {calls_text(row)} | "
                     f"`{EQUATIONS[row.op]}` | {shapes_text(row)} | "
                     f"{reference_link(row.op, functions)} | {kernel_links(row)} |")
    return lines


def cost_table(rows, first):
    """The rows' FLOPs, bytes and floors: per call where the calls are alike, and in the step."""
    lines = ["| # | op | calls | GFLOP | MB | floor (us) | step floor tf32 (ms) "
             "| step floor bf16 (ms) | bound |",
             "|---|---|---|--:|--:|--:|--:|--:|---|"]
    for i, row in enumerate(rows, first):
        n = len(row.calls) if uniform(row) else 1
        calls = calls_text(row) if uniform(row) else f"{calls_text(row)}, summed"
        lines.append(f"| {i} | `{row.op}` | {calls} | {num(row.flops / n / 1e9)} | "
                     f"{num(row.bytes / n / 1e6)} | {num(row.floor_ns['tf32'] / n / 1e3)} | "
                     f"{row.floor_ns['tf32'] / 1e6:.3f} | {row.floor_ns['bf16'] / 1e6:.3f} | "
                     f"{row.bound} |")
    return lines


def ms(value):
    """A recorded time as recorded; '-' where none was."""
    return "-" if value is None else str(value)


def num(value):
    """A figure with three significant digits or more: 633, 38.67, 0.00315."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def totals_table(planned, measured):
    """Per direction: launches, GFLOP, GB moved and floor of each precision; then the step."""
    by = {p: {d["direction"]: d for d in direction_rows(plan)} for p, plan in planned.items()}
    lines = ["| direction | launches tf32 | GFLOP | GB moved tf32 | floor tf32 (ms) "
             "| launches bf16 | GB moved bf16 | floor bf16 (ms) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for direction, d in by["tf32"].items():
        h = by["bf16"][direction]
        lines.append(f"| {direction} | {d['launches']} | {d['flops'] / 1e9:,.1f} | "
                     f"{d['hbm_bytes'] / 1e9:.2f} | {d['floor_ns'] / 1e6:.3f} | {h['launches']} | "
                     f"{h['hbm_bytes'] / 1e9:.2f} | {h['floor_ns'] / 1e6:.3f} |")
    t, h = planned["tf32"], planned["bf16"]
    lines.append(f"| **step** | {len(t.kernels)} | {t.flops / 1e9:,.1f} | "
                 f"{sum(x.hbm_bytes for x in t.launches) / 1e9:.2f} | {t.floor_ns / 1e6:.3f} | "
                 f"{len(h.kernels)} | {sum(x.hbm_bytes for x in h.launches) / 1e9:.2f} | "
                 f"{h.floor_ns / 1e6:.3f} |")
    step = measured["step"]
    lines.append(f"| **measured step** | | | | {ms(step['tf32_ms'])} | | | {ms(step['bf16_ms'])} |")
    return lines


def op_floors(rows):
    """{(direction, op): (calls, {precision: floor ns})} over all modules, in step order."""
    calls, floors = {}, {}
    for row in rows:
        key = row.direction, row.op
        calls.setdefault(key, set()).update(row.calls)
        for precision, floor in row.floor_ns.items():
            floors.setdefault(key, {})[precision] = floors.get(key, {}).get(precision, 0.0) + floor
    return {key: (len(calls[key]), floors[key]) for key in calls}


def measured_table(planned, rows, measured):
    """Every op of the step with its floor beside the H100's measured time ('-': none recorded),
    then the recorded groups of ops and the whole step."""
    recorded = {(m["direction"], m["op"]): m for m in measured["ops"]}
    unknown = set(recorded) - {(row.direction, row.op) for row in rows}
    if unknown:
        raise KeyError(f"{MEASURED.name} names ops the step does not run: {sorted(unknown)}")
    lines = ["| op | direction | calls | floor tf32 | H100 tf32 | floor bf16 | H100 bf16 "
             "| recorded |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for (direction, op), (calls, floors) in op_floors(rows).items():
        m = recorded.get((direction, op), {})
        lines.append(f"| `{op}` | {direction} | {calls} | {floors['tf32'] / 1e6:.3f} | "
                     f"{ms(m.get('tf32_ms'))} | {floors['bf16'] / 1e6:.3f} | "
                     f"{ms(m.get('bf16_ms'))} | {m.get('note', '')} |")
    for group in measured["groups"]:
        floors = {}
        for precision, plan in planned.items():
            floors[precision] = sum(
                x.floor_ns or 0.0 for x in plan.launches
                if x.record.op in group.get("ops", ())
                or x.record.kernel.startswith(group.get("kernels", "\0")))
        lines.append(f"| {group['name']} | | | {floors['tf32'] / 1e6:.3f} | "
                     f"{ms(group['tf32_ms'])} | {floors['bf16'] / 1e6:.3f} | "
                     f"{ms(group['bf16_ms'])} | {group['note']} |")
    step = measured["step"]
    lines.append(f"| **the step** | | | {planned['tf32'].floor_ns / 1e6:.3f} | "
                 f"{ms(step['tf32_ms'])} | {planned['bf16'].floor_ns / 1e6:.3f} | "
                 f"{ms(step['bf16_ms'])} | {step['note']} |")
    return lines


COPY_WORDS = {"[CUDA memcpy HtoD]": "token uploads, host to device",
              "[CUDA memset]": "a gradient buffer set to zero",
              "[CUDA memcpy DtoH]": "the loss and grad norm read back, device to host"}


def copies_table(copies):
    """The copies and memsets of the step: count, bytes, floor (a host copy has none)."""
    lines = ["| copy | direction | what | count | bytes | floor tf32 (us) |",
             "|---|---|---|--:|--:|--:|"]
    for (direction, kind), by in copies.items():
        n, nbytes, floor = by["tf32"]
        lines.append(f"| `{kind}` | {direction} | {COPY_WORDS.get(kind, '')} | {n} | {nbytes:,} | "
                     f"{floor / 1e3:.1f} |")
    return lines


INTRO = """\
# One training step, op by op

This page lists every op of one GPT-2 training step, in the order a GPU runs it.
The step is d12 (GPT-2 124M) at B=4, T=1024, as `gpt2np train` runs it on a GPU.
That means flash attention, fused ops and every activation kept (`-r 0`).
Each op has its equation, its shapes, its work and its time on an H100.

`python docs/make_step.py > docs/step.md` writes this page; do not edit it by hand.
The script runs the roofline planner on the CPU; no GPU is needed.
The planner runs the real model and `train_step` on the CUDA backend,
over a runtime that does no work.
So the ops, their order, shapes and kernels are those of a real step.
`tests/test_docs.py` fails when this page differs from the script's output.

## How to read the tables

- **equation**: what the op computes, in one line. Shape names follow
  [the op contract](../gpt2np/ops/contract.py): B batch, T time, C channels, OC output channels.

- `+=` adds into a gradient.
  The first micro-batch of a step overwrites it, so no `zero_grad` pass runs.

- **NumPy reference**: the plain NumPy function that defines the op on the CPU.
  A fused op equals the functions it joins, in order.

- **CUDA kernels**: the kernels of `kernels/*.cu` that run it; cuBLAS runs the GEMMs.
  A name marked (bf16) runs in the bf16 build only.

- **GFLOP** and **MB**: the op contract's cost formulas for one call, in fp32 storage.
  MB counts the minimum traffic: each input read once, each output written once.

- **floor**: the least time the op can take on an H100 SXM.
  It is max(FLOPs / peak, bytes / bandwidth), with the peaks of `gpt2np/profiling/gpu_specs.py`.
  GEMMs and flash attention use the tensor-core peak of the precision; other kernels the fp32 peak.

- **calls**: x12 is once per layer. The layer rows show one call; the step floors show all of them.

- **bound**: whether the floor comes from the arithmetic (compute) or the memory traffic.

A d12 step repeats 12 identical layers.
The tables show the embedding, one layer's ops, `ln_f`, the classifier and the optimizer.
The last op of each layer adds the residual and normalizes for the next layer (`ln_1`, or `ln_f`).
"""

MEASURED_TEXT = """\
## Measured on an H100

These times were recorded on an {gpu} at commit `{commit}`.
They are CUPTI device times of one eager step, summed over the op's calls, in ms.
A dash means that no figure was recorded for the op.
The figures, their source and their date are in [step_h100.json](step_h100.json).
The measured step runs as one CUDA graph; the planner's floor assumes no gaps between kernels.
"""

LIMITS = """\
## Limits

- The floors are a model from peak rates, not a measurement.
- The H100 figures cover only the ops listed with a time.
  The GEMMs were recorded as one group, so each GEMM row has a floor but no time.
- The bf16 figures are for the same step with `--precision bf16`.
  Its bias gradients run as column-sum kernels, so it launches more kernels than tf32.
"""


def render():
    """The text of docs/step.md."""
    planned = plans()
    measured = json.loads(MEASURED.read_text())
    rows, copies = step_rows(planned)
    functions = reference_functions()
    t = planned["tf32"]
    lines = INTRO.splitlines() + [
        "", "## The step in numbers", "",
        f"The tf32 step does {t.flops / 1e9:,.1f} GFLOP in {len(t.kernels)} kernel launches.",
        f"Its floor on the H100 is {t.floor_ns / 1e6:.2f} ms.",
        f"The measured step took {ms(measured['step']['tf32_ms'])} ms, as one CUDA graph.", ""]
    lines += totals_table(planned, measured)
    first = 1
    for direction, title in SECTIONS:
        part = [row for row in rows if row.direction == direction]
        lines += ["", f"## {title}", "", "What each op computes, and the code that runs it:", ""]
        lines += what_table(part, functions, first)
        lines += ["", "What each op costs:", ""]
        lines += cost_table(part, first)
        first += len(part)
    lines += ["", "## Copies and memsets", "",
              "The step also moves a few bytes between host and device, and clears one buffer.", ""]
    lines += copies_table(copies)
    measured_text = MEASURED_TEXT.format(gpu=measured["gpu"], commit=measured["commit"])
    lines += [""] + measured_text.splitlines()
    lines += [""] + measured_table(planned, rows, measured)
    lines += [""] + LIMITS.splitlines()
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
