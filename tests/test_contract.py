"""The op contract is code: both backends implement every op of the Protocol with its signature, and
each op's cost is one formula that the CUDA kernels split by term and the NumPy ops report whole."""
import inspect
from collections import Counter, defaultdict

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.bf16 import BF16
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.ops.contract import COSTS, DEVICE_STEP_OPS, OP_METHODS, Backend, gemm_term, op_cost
from gpt2np.profiling.profiler import profile_steps

CFG = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                 channels=16)
# the flash attention kernels need head size 64
FLASH_CFG = GPT2Config(max_seq_len=40, vocab_size=100, padded_vocab_size=128, num_layers=1,
                       num_heads=2, channels=128)
CONFIGS = {"naive": CFG, "flash": FLASH_CFG}
B, T = 2, 8
# every op a host training step runs (the model folds residual_backward into the residual stream's
# gradient; the device step adds DEVICE_STEP_OPS), with one of the two attentions, unfused or fused
# (GPT2(fuse=...): the fused ops replace residual_forward and the GELU ops)
ATTENTION_OPS = {"naive": {"attention_forward", "attention_backward"},
                 "flash": {"flash_attention_forward", "flash_attention_backward"}}
FUSED_OPS = {"fused_residual_layernorm_forward", "matmul_gelu_forward", "gelu_matmul_backward"}
STEP_OPS = {(attention, fuse): set(COSTS) - {"residual_backward"} - set(DEVICE_STEP_OPS)
            - ATTENTION_OPS["flash" if attention == "naive" else "naive"]
            - ({"residual_forward", "gelu_forward", "gelu_backward"} if fuse else FUSED_OPS)
            for attention in ATTENTION_OPS for fuse in (False, True)}
CASES = sorted(STEP_OPS)
# the storage precisions: their cost formulas differ (2-byte terms; bf16's bias gradients by
# the column-sum kernels)
PRECISIONS = ("fp32", "bf16")


def contract_methods():
    return [name for name, member in vars(Backend).items()
            if callable(member) and not name.startswith("_")]


@pytest.mark.parametrize("backend_name, precision",
                         [("numpy", "fp32"), ("numpy", "bf16"), ("emu", "fp32"), ("emu", "bf16")])
def test_backends_implement_every_contract_method_with_its_signature(backend_name, precision):
    backend = get_backend(backend_name, precision=precision)
    for name in contract_methods():
        ours = inspect.signature(getattr(type(backend), name))
        want = inspect.signature(getattr(Backend, name))
        assert list(ours.parameters) == list(want.parameters), f"{type(backend).__name__}.{name}"
    assert (backend.name in ("numpy", "cuda")
            and backend.dtype == (np.float32 if precision == "fp32" else BF16))
    assert backend.launches_kernels == (backend.name == "cuda") and backend.on_launch is None
    assert backend.precision == precision and isinstance(backend.device_name(), str)


def test_every_costed_op_is_a_contract_method_and_back():
    ops = {method for op in COSTS for method in OP_METHODS.get(op, (op,))}
    compute = {name for name in contract_methods() if name not in (
        "zeros", "from_host", "to_host", "copy_", "fill_", "upload_", "read_async", "synchronize",
        "device_name", "precision")}
    assert ops == compute


def test_gemm_term_and_hand_counts():
    assert gemm_term(3, 5, 7) == (2 * 3 * 5 * 7, 4 * (3 * 7 + 7 * 5 + 3 * 5))
    assert gemm_term(3, 5, 7, batch=2, accumulate=True) == (2 * 2 * 3 * 5 * 7,
                                                            4 * 2 * (3 * 7 + 7 * 5 + 2 * 3 * 5))
    def z(shape):
        return np.zeros(shape, np.float32)
    # matmul_forward on (B,T,C) @ (OC,C)^T + bias: the GEMM plus one add per output
    cost = op_cost("matmul_forward", (z((2, 4, 48)), z((2, 4, 16)), z((48, 16)), z(48)))
    assert cost.flops == 2 * 8 * 16 * 48 + 8 * 48
    assert cost.params == "B=2,T=4,C=16,OC=48,M=8,N=48,K=16"
    assert (set(op_cost("matmul_forward", (z((2, 4, 48)), z((2, 4, 16)), z((48, 16)), None)).terms)
            == {"gemm"})
    # a parameter gradient that accumulates reads its old value: more bytes than overwriting it
    args = (z((2, 4, 16)), z((48, 16)), z(48), z((2, 4, 48)), z((2, 4, 16)), z((48, 16)))
    assert (op_cost("matmul_backward", args + (True,)).bytes
            > op_cost("matmul_backward", args + (False,)).bytes)
    assert (op_cost("adamw", (z(10), z(10), z(10), z(10), 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0)).bytes
            == 4 * 7 * 10)
    with pytest.raises(KeyError, match="no cost formula"):
        op_cost("softmax_of_nothing", ())


def test_encoder_counts_wpe_once_and_the_zeroed_rows_of_dwpe():
    """encoder_forward reads the B*T token ids and their wte rows and wpe[:T] once (each input once:
    every sequence adds the same T rows), and writes out. encoder_backward without accumulate
    overwrites all of dwpe: the T summed rows and the maxT - T zeroed ones past T, each a write;
    accumulating, it reads and writes the T rows only."""
    def z(shape, dtype=np.float32):
        return np.zeros(shape, dtype)
    Bx, Tx, C, Vp, maxT = 3, 5, 8, 32, 12
    n = Bx * Tx * C
    cost = op_cost("encoder_forward",
                   (z((Bx, Tx, C)), z((Bx, Tx), np.int32), z((Vp, C)), z((maxT, C))))
    assert cost.terms == {"encode": (n, 4 * (n + Tx * C + n) + 4 * Bx * Tx)}
    args = (z((Vp, C)), z((maxT, C)), z((Bx, Tx, C)), z((Bx, Tx), np.int32))
    dwte = (n, 4 * (n + 2 * Bx * Tx * C) + 4 * Bx * Tx)
    assert op_cost("encoder_backward", args, {"accumulate": False}).terms == {
        "dwte": dwte, "dwpe": (n, 4 * (n + Tx * C)), "dwpe_tail": (0, 4 * (maxT - Tx) * C)}
    assert op_cost("encoder_backward", args, {"accumulate": True}).terms == {
        "dwte": dwte, "dwpe": (n, 4 * (n + 2 * Tx * C))}
    # T = maxT: nothing past T
    full = (z((Vp, C)), z((Tx, C)), z((Bx, Tx, C)), z((Bx, Tx), np.int32))
    assert set(op_cost("encoder_backward", full, {"accumulate": False}).terms) == {"dwte", "dwpe"}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_flash_attention_backward_counts_what_its_kernels_compute(precision):
    """Hand counts from kernels/flash_attention.cu, per causal (query, key) pair and per element of
    a (B,T,C) array: delta reads dout and out and writes D (B,NH,T); dkv and dq each recompute S = q
    k^T and dP = dout v^T (2 HS FLOPs each), P = exp(S scale - lse) and dS = P (dP - D) scale (6
    FLOPs) and read q, k, v, dout, lse and D; dkv then computes dV = P^T dout and dK = dS^T q and
    writes dk and dv, dq computes dQ = dS k and writes dq."""
    from gpt2np.bf16 import BF16
    dtype = BF16 if precision == "bf16" else np.float32
    X = np.dtype(dtype).itemsize
    Bx, Tx, NH, HS = 2, 40, 2, 64
    C = NH * HS
    n, rows, pairs = Bx * Tx * C, Bx * NH * Tx, Bx * NH * Tx * (Tx + 1) // 2
    arrays = (np.zeros((Bx, Tx, 3 * C), dtype), np.zeros((Bx, Tx, C), dtype),
              np.zeros((Bx, Tx, 3 * C), dtype),
              np.zeros((Bx, Tx, C), dtype), np.zeros((Bx, NH, Tx), np.float32))
    cost = op_cost("flash_attention_backward", arrays)
    assert cost.terms == {
        "delta": (2 * n, X * 2 * n + 4 * rows),
        "dkv": (4 * 2 * HS * pairs + 6 * pairs, X * (4 * n + 2 * n) + 4 * 2 * rows),
        "dq": (3 * 2 * HS * pairs + 6 * pairs, X * (4 * n + n) + 4 * 2 * rows),
    }
    # seven (query, key)-pair products in all, five of them the math's and two the recomputation's
    assert cost.flops == 14 * HS * pairs + 12 * pairs + 2 * n


def batches():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, CFG.vocab_size, (2, B, T + 1)).astype(np.int32)
    return [(b[:, :-1], b[:, 1:]) for b in raw]


def totals(records):
    """{(op, module, direction, layer): (FLOPs, bytes, params)} summed over the kernel records of
    one step (copies and memsets are records too; encoder_backward's dwpe kernels are wpe's, the
    NumPy op's one record wte's)."""
    out = defaultdict(lambda: [0, 0, set()])
    for r in records:
        if r.kind != "kernel":
            continue
        row = out[(r.op, "wte" if r.module == "wpe" else r.module, r.direction, r.layer)]
        row[0] += r.flops
        row[1] += r.bytes
        row[2].add(r.params)
    return {key: tuple(row[:2]) + (frozenset(row[2]),) for key, row in out.items()}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("attention,fuse", CASES)
def test_cuda_kernels_add_up_to_the_numpy_op_cost(attention, fuse, precision):
    """One step profiled on the emulated CUDA backend and on NumPy: per op and module, the CUDA
    kernels' FLOPs and bytes add up to exactly what the NumPy op reports, the contract's one formula
    (fused or not), in fp32 and in bf16 (whose formulas and kernels differ: bf16 sums the bias
    gradients with the column-sum kernels, never in a GEMM epilogue)."""
    def step_records(backend):
        prof = profile_steps(GPT2(CONFIGS[attention], backend, B, T, seed=0,
                                  attention=attention, fuse=fuse),
                             batches(), steps=1)
        return [r for r in prof.records if r.step == 1]

    cuda_records = step_records(get_backend("emu", precision))
    numpy_records = step_records(get_backend("numpy", precision, threads=1, math="exact"))
    assert len(cuda_records) > len(numpy_records)            # several kernels per op
    assert ({r.op for r in cuda_records if r.kind == "kernel"}
            == STEP_OPS[attention, fuse] | set(DEVICE_STEP_OPS))
    cuda_totals = {key: row for key, row in totals(cuda_records).items()
                   if key[0] not in DEVICE_STEP_OPS}
    assert cuda_totals == totals(numpy_records)
    assert {r.op for r in numpy_records} == STEP_OPS[attention, fuse]
    assert all(r.flops + r.bytes > 0 for r in numpy_records)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("attention,fuse", CASES)
def test_every_cuda_launch_names_a_term_of_its_op_once(attention, fuse, precision):
    """Straight from the launch hook: within one op call no term is carried twice, and every term is
    carried (fp32 and bf16: each build's kernels, each precision's formulas)."""
    backend = get_backend("emu", precision)
    model = GPT2(CONFIGS[attention], backend, B, T, seed=0, attention=attention, fuse=fuse)
    x, y = batches()[0]
    # [(op, its Cost, Counter of the terms its kernels carried)] while an op runs
    current = []
    checked = Counter()

    class OpTracker:
        def on_push(self, name, detail):
            if detail is not None:
                current.append((name, op_cost(name, detail[1], detail[2]), Counter()))

        def on_pop(self, name):
            if current and current[-1][0] == name:
                op, cost, terms = current.pop()
                assert terms == Counter(set(cost.terms)), (op, terms, set(cost.terms))
                checked[op] += 1

    def hook(kernel, kind, term, run):
        assert current, f"{kernel} launched outside an op"
        if term is not None:
            current[-1][2][term] += 1
        run()

    from gpt2np import ranges
    tracker = OpTracker()
    ranges.add_listener(tracker)
    backend.on_launch = hook
    try:
        model.zero_grad()
        model.forward(x, y, for_backward=True)
        model.backward()
        model.update(1e-3, step=1)
    finally:
        backend.on_launch = None
        ranges.remove_listener(tracker)
    assert set(checked) == STEP_OPS[attention, fuse] and not current


def test_fused_costs_move_less_data():
    """The fused forms' formulas: the bias in the GEMM saves a pass over out, the bias gradient in
    the dweight GEMM a pass over dout, residual + LayerNorm a write and a read of the residual, the
    one-pass backward a read of dout and inp; the FLOPs stay."""
    def z(shape):
        return np.zeros(shape, np.float32)
    x, w, b, out = z((2, 4, 16)), z((48, 16)), z(48), z((2, 4, 48))
    assert (op_cost("matmul_forward", (out, x, w, b, True)).bytes
            < op_cost("matmul_forward", (out, x, w, b)).bytes)
    assert (op_cost("matmul_forward", (out, x, w, b, True)).flops
            == op_cost("matmul_forward", (out, x, w, b)).flops)
    for acc in (True, False):
        args = (x, w, b, out, x, w, acc)
        assert (op_cost("matmul_backward", args + (True,)).bytes
                < op_cost("matmul_backward", args).bytes)
    y, m = z((2, 4, 16)), z((2, 4))
    fused = op_cost("fused_residual_layernorm_forward", (y, y, m, m, y, y, z(16), z(16)))
    apart = op_cost("residual_forward", (y, y, y)), op_cost("layernorm_forward",
                                                            (y, m, m, y, z(16), z(16)))
    assert fused.bytes < sum(c.bytes for c in apart) and fused.flops == sum(c.flops for c in apart)
    ln = (y, z(16), z(16), y, y, z(16), m, m, True)
    assert (op_cost("layernorm_backward", ln + (True,)).bytes
            < op_cost("layernorm_backward", ln).bytes)
    assert (op_cost("layernorm_backward", ln + (True,)).flops
            == op_cost("layernorm_backward", ln).flops)
    h = z((2, 4, 64))
    gelu = op_cost("matmul_gelu_forward", (h, h, x, z((64, 16)), z(64)))
    apart = op_cost("matmul_forward", (h, x, z((64, 16)), z(64))), op_cost("gelu_forward", (h, h))
    assert gelu.bytes < sum(c.bytes for c in apart) and gelu.flops == sum(c.flops for c in apart)


def test_bf16_storage_halves_the_bytes_of_storage_terms():
    """bf16 arrays move 2 bytes per element where fp32 ones move 4; statistics (mean, rstd, losses,
    lse) stay 4 bytes, and AdamW with fp32 master weights moves 28 bytes per parameter either way
    (bf16: reads master, g, m, v; writes p, master, m, v)."""
    from gpt2np.bf16 import BF16

    def arrays(dtype, *shapes):
        return tuple(np.zeros(s, dtype) for s in shapes)

    f32 = op_cost("matmul_forward", arrays(np.float32, (2, 4, 48), (2, 4, 16), (48, 16), 48))
    b16 = op_cost("matmul_forward", arrays(BF16, (2, 4, 48), (2, 4, 16), (48, 16), 48))
    assert b16.flops == f32.flops and 2 * b16.bytes == f32.bytes
    stats = (np.zeros((2, 4), np.float32),) * 2
    f32, b16 = (op_cost("layernorm_forward",
                        (*arrays(t, (2, 4, 16)), *stats, *arrays(t, (2, 4, 16), 16, 16)))
                for t in (np.float32, BF16))
    # the (N,C) and (C) arrays; mean, rstd unchanged
    assert f32.bytes - b16.bytes == 2 * (2 * 8 * 16 + 2 * 16)
    n = 10
    moments = arrays(np.float32, n, n)
    assert op_cost("adamw", (*arrays(BF16, n, n), *moments, 1e-3)).bytes == 28 * n
    assert op_cost("adamw", (*arrays(np.float32, n, n), *moments, 1e-3)).bytes == 28 * n
    assert op_cost("global_norm", arrays(BF16, n)).bytes == 2 * n
    # -w 0 (master=None): reads p, g, m, v and writes p, m, v, 6 bytes a parameter less; a
    # master is 28 as above
    hyper = (1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0)
    assert (op_cost("adamw", (*arrays(BF16, n, n), *moments, *hyper), {"master": None}).bytes
            == 22 * n)
    master = {"master": np.zeros(n, np.float32), "seed": 0, "offset": 0}
    assert op_cost("adamw", (*arrays(BF16, n, n), *moments, *hyper), master).bytes == 28 * n


@pytest.mark.parametrize("device", ["numpy", "emu"])
@pytest.mark.parametrize("master_weights", [True, False])
def test_profiled_bf16_adamw_counts_the_master_weights_it_moves(device, master_weights):
    """The profiler costs AdamW with the op's keywords: a bf16 step with fp32 masters moves 28 bytes
    a parameter, one without (-w 0) 22 (the range carries the call's keywords, so the record knows
    which ran), on the host step (numpy's adamw op) and on the device step (the adamw_update_device
    kernel, emulated)."""
    from gpt2np.profiling.profiler import Profiler
    from gpt2np.train_step import train_step
    cfg = GPT2Config(max_seq_len=8, vocab_size=64, padded_vocab_size=64, num_layers=1, num_heads=2,
                     channels=16)
    be = get_backend(device, "bf16")
    model = GPT2(cfg, be, 2, 8, seed=0, master_weights=master_weights)
    x = np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32)
    with Profiler(be) as prof:
        result = train_step(model, lambda: (x, x), step=0, lr=1e-3)
        getattr(result, "resolve", lambda: None)()
    adamw = [r for r in prof.records if r.kernel in ("numpy.adamw", "adamw_update_device")]
    assert (adamw and sum(r.bytes for r in adamw)
            == (28 if master_weights else 22) * model.num_parameters)
