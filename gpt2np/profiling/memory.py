"""Parameters per GPT-2 module and the model's memory by buffer, for the module tree
and the model summary.

    module_parameters(cfg) -> {"wte": Vp*C, "wpe": maxT*C, "h.0.ln_1": 2C,
                               "h.0.attn.c_attn": 3C*C + 3C, ...}
    memory_summary(model)  -> {"buffers": [{"buffer", "bytes", "what"}...], "total": ...,
                               "peak": ..., ...}

The numbers come from the model's own buffers (llm.c's discipline: a few flat buffers allocated up
front): parameters, gradients, AdamW m and v, the fp32 master weights of a bf16 run, activations
(per activation tensor too, each at its own element size: bf16 storage is 2 bytes, its fp32
LayerNorm statistics and losses 4), the gradient scratch
reused by every layer, the token buffers and the backend's work buffers (scratch). The measured peak
is the process's peak resident set (host RSS, getrusage) on the CPU and the emulator, and the CuPy
memory pool's bytes on a GPU (the pool keeps what it allocated, so its total is the
high-water mark of the pool).
"""
import sys
from typing import Dict, Optional

import numpy as np

from gpt2np.tensors import FP32_ACTIVATIONS, activation_shapes, param_shapes

MiB = 1024 * 1024

# parameter tensor -> the module it belongs to ({l}: the layer)
PARAM_MODULES = {"wte": "wte", "wpe": "wpe", "ln1w": "h.{l}.ln_1", "ln1b": "h.{l}.ln_1",
                 "qkvw": "h.{l}.attn.c_attn", "qkvb": "h.{l}.attn.c_attn",
                 "attprojw": "h.{l}.attn.c_proj", "attprojb": "h.{l}.attn.c_proj",
                 "ln2w": "h.{l}.ln_2", "ln2b": "h.{l}.ln_2", "fcw": "h.{l}.mlp.c_fc",
                 "fcb": "h.{l}.mlp.c_fc", "fcprojw": "h.{l}.mlp.c_proj",
                 "fcprojb": "h.{l}.mlp.c_proj", "lnfw": "ln_f", "lnfb": "ln_f"}


def module_parameters(cfg) -> Dict[str, int]:
    """Parameters of each leaf module (lm_head has none of its own: it is tied to wte)."""
    out: Dict[str, int] = {}
    for name, shape in param_shapes(cfg).items():
        module = PARAM_MODULES[name]
        if "{l}" in module:
            per_layer = int(np.prod(shape[1:]))
            for l in range(cfg.num_layers):
                key = module.format(l=l)
                out[key] = out.get(key, 0) + per_layer
        else:
            out[module] = out.get(module, 0) + int(np.prod(shape))
    out["lm_head"] = 0
    return out


def _nbytes(array) -> int:
    return 0 if array is None else int(array.size) * int(array.dtype.itemsize)


def memory_summary(model, peak: Optional[dict] = None) -> dict:
    """The model's buffers (bytes each, from the arrays themselves) and the measured peak.

    peak: {"bytes", "what"} (default: measured_peak(model.backend)).
    """
    cfg = model.cfg
    dtype = np.dtype(model.params.dtype)
    stats = getattr(model, "acts_fp32", None)
    rows = [("parameters", _nbytes(model.params), f"{model.num_parameters:,} {dtype.name}"),
            ("gradients", _nbytes(model.grads), f"same layout as the parameters, {dtype.name}"),
            ("AdamW m", _nbytes(model.m),
             "allocated at the first update" if model.m is None else "first moment"),
            ("AdamW v", _nbytes(model.v),
             "allocated at the first update" if model.v is None else "second moment")]
    if dtype != np.float32:
        master = getattr(model, "master", None)
        rows.append(("master weights", _nbytes(master),
                     "none (-w 0): AdamW updates the bf16 parameters"
                     if not getattr(model, "master_weights", True)
                     else "float32, allocated at the first update" if master is None
                     else "float32 copy AdamW updates"))
    rows += [("activations", _nbytes(model.acts) + _nbytes(stats),
              f"kept for backward, B={model.B}, "
              f"T={model.T}" + (f", -r {model.recompute}" if getattr(model, "recompute", 0) else "")
              + (f"; {dtype.name}, LayerNorm statistics and losses float32"
                 if stats is not None else "")),
             ("gradient scratch",
              sum(_nbytes(a) for a in (model.dresidual, model.dbtc, model.dbt3c, model.dbt4c)),
              "dresidual, (B,T,C), (B,T,3C), (B,T,4C): reused by every layer"),
             ("tokens", sum(_nbytes(a) for a in model.token_slots[0]),
              "inputs and targets (int32)")]
    scratch = getattr(model.backend, "_scratch", None) or {}
    rows.append(("backend scratch", sum(_nbytes(a) for a in scratch.values()),
                 f"{len(scratch)} work buffer{'' if len(scratch) == 1 else 's'} of the "
                 f"{model.backend.name} backend"))
    buffers = [{"buffer": name, "bytes": int(n), "what": what} for name, n, what in rows]
    acts = []
    shapes = activation_shapes(cfg, model.B, model.T, getattr(model, "attention", "naive"),
                               getattr(model, "recompute", 0))
    for name, shape in shapes.items():
        itemsize = (stats.dtype.itemsize if stats is not None and name in FP32_ACTIVATIONS
                    else model.acts.dtype.itemsize)
        acts.append({"buffer": name, "bytes": int(np.prod(shape)) * int(itemsize),
                     "shape": list(shape)})
    acts.sort(key=lambda a: -a["bytes"])
    return {"buffers": buffers, "total": sum(b["bytes"] for b in buffers), "activations": acts,
            "peak": peak if peak is not None else measured_peak(model.backend)}


def measured_peak(backend) -> dict:
    """{"bytes", "what"}: the CuPy pool's bytes on a GPU, else the process's peak RSS (None if
    unknown)."""
    if backend.on_gpu:
        return cupy_pool_peak(backend.rt.cp)
    return host_peak_rss()


def cupy_pool_peak(cp) -> dict:
    """The default CuPy memory pool: total_bytes() (what it holds: it keeps freed blocks, so this is
    its high-water mark) and used_bytes() (live arrays now)."""
    pool = cp.get_default_memory_pool()
    return {"bytes": int(pool.total_bytes()), "used_bytes": int(pool.used_bytes()),
            "what": "CuPy memory pool, bytes held (its high-water mark)"}


def host_peak_rss() -> dict:
    """The process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        import resource  # POSIX only
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024
        return {"bytes": int(rss) * scale, "what": "host peak RSS of this process (getrusage)"}
    except (ImportError, OSError):
        return {"bytes": None, "what": "peak unknown on this platform"}
