"""NVTX ranges: the exact range tree gpt2np emits, observed through a real NVTX tool.

tests/nvtx_inject/inject.c is a minimal NVTX injection library (the mechanism Nsight Systems uses):
the nvtx package's C code loads it from NVTX_INJECTION64_PATH and routes every range push/pop to it,
and it logs them to NVTX_INJECT_LOG. We compile it with gcc, run small Python programs with it
attached, and rebuild the range tree per thread from the log.
"""
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from gpt2np import ranges

REPO = Path(__file__).resolve().parents[1]
INJECT_SOURCE = Path(__file__).resolve().parent / "nvtx_inject" / "inject.c"


# ---- the injection library and its log ----------------------------------------------------------

@pytest.fixture(scope="module")
def inject_lib(tmp_path_factory):
    """Path of the compiled injection library."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the NVTX injection library")
    pytest.importorskip("nvtx", reason="the nvtx package is not installed")
    lib = tmp_path_factory.mktemp("nvtx_inject") / "libnvtx_inject.so"
    done = subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(lib),
                           str(INJECT_SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return lib


def run_traced(program, inject_lib, tmp_path, env_extra=None):
    """Run `program` (Python source) with the injection library attached; return its log events."""
    log = tmp_path / "nvtx.log"
    env = {k: v for k, v in os.environ.items() if k not in ("GPT2NP_NVTX", "NVTX_DISABLE")}
    env.update(NVTX_INJECTION64_PATH=str(inject_lib), NVTX_INJECT_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"traced program failed:\n{done.stdout}\n{done.stderr}"
    return parse_log(log), done.stdout


def unescape(text):
    out, chars = [], iter(text)
    for c in chars:
        if c == "\\":
            c = {"t": "\t", "n": "\n", "\\": "\\"}[next(chars)]
        out.append(c)
    return "".join(out)


def parse_log(log):
    """Log lines -> [(kind, tid, depth, domain, message or None)] in order."""
    if not log.exists():            # nothing ever initialised NVTX, so the tool was never loaded
        return []
    events = []
    for line in log.read_text(encoding="utf-8").splitlines():
        kind, tid, depth, domain, *message = line.split("\t")
        events.append((kind, int(tid), int(depth), unescape(domain),
                       unescape(message[0]) if message else None))
    return events


def range_trees(events):
    """Events -> {tid: [root trees]} where a tree is (name, (child trees...)).

    Checks that pushes and pops balance on every thread and that the depth the tool saw matches
    the nesting."""
    open_ranges, roots = {}, {}
    for kind, tid, depth, domain, message in events:
        assert domain == "", f"range outside the default domain: {domain!r}"
        stack = open_ranges.setdefault(tid, [])
        assert depth == (len(stack) if kind == "push"
                         else len(stack) - 1), f"bad depth in {kind} {message}"
        if kind == "push":
            stack.append((message, []))
        else:
            name, children = stack.pop()
            tree = (name, tuple(children))
            (stack[-1][1] if stack else roots.setdefault(tid, [])).append(tree)
    for tid, stack in open_ranges.items():
        assert not stack, f"thread {tid} left ranges open: {[name for name, _ in stack]}"
    return roots


def render(trees, indent=0):
    """Indented outline of trees; compared as text so a mismatch shows a readable diff."""
    lines = []
    for name, children in trees:
        lines.append("  " * indent + name)
        lines.extend(render(children, indent + 1).splitlines())
    return "\n".join(lines)


def node(name, *children):
    return (name, tuple(children))


# ---- (i) a synthetic program: exact tree, threads, exceptions, odd names ------------------------

def test_synthetic_program_tree_is_recovered_exactly(inject_lib, tmp_path):
    events, out = run_traced("""
        import threading
        from gpt2np import ranges

        def worker():
            with ranges.range("worker"):
                with ranges.range("inner"):
                    pass

        with ranges.range("step 1"):
            with ranges.range("a"):
                with ranges.range("b"):
                    pass
                with ranges.range("b"):
                    pass
            try:
                with ranges.range("raises"):
                    with ranges.range("deep"):
                        raise KeyError("boom")
            except KeyError:
                pass
            with ranges.range("naïve ✓ tab\\there"):
                pass
            thread = threading.Thread(target=worker)
            thread.start()
            thread.join()
        with ranges.range("step 2"):
            pass
        print(threading.get_native_id(), thread.native_id)
    """, inject_lib, tmp_path)
    main_tid, worker_tid = map(int, out.split())
    trees = range_trees(events)
    assert set(trees) == {main_tid, worker_tid}
    expected_main = [
        node("step 1",
             node("a", node("b"), node("b")),
             node("raises", node("deep")),
             node("naïve ✓ tab\there")),
        node("step 2"),
    ]
    assert trees[main_tid] == expected_main, render(trees[main_tid])
    assert trees[worker_tid] == [node("worker", node("inner"))]


# ---- (ii) turned off: nothing reaches NVTX -------------------------------------------------------

def test_disabled_emits_nothing(inject_lib, tmp_path):
    events, _ = run_traced("""
        from gpt2np import ranges
        ranges.enable(False)
        with ranges.range("outer"):
            with ranges.range("inner"):
                pass
        assert not ranges.enabled()
    """, inject_lib, tmp_path)
    assert events == []


def test_env_var_off_by_default_and_enable_overrides(inject_lib, tmp_path):
    events, _ = run_traced("""
        from gpt2np import ranges
        assert not ranges.enabled()
        with ranges.range("hidden"):
            pass
        ranges.enable(True)
        with ranges.range("shown"):
            with ranges.range("child"):
                ranges.enable(False)          # ranges open when it is turned off still close
                with ranges.range("hidden too"):
                    pass
    """, inject_lib, tmp_path, env_extra={"GPT2NP_NVTX": "0"})
    assert list(range_trees(events).values()) == [[node("shown", node("child"))]]


# ---- (iii) one full training step of a tiny model ----------------------------------------------

# What one training step (gpt2np.train_step, as the trainer runs it) emits: forward, backward, grad
# norm and update under "Train step N". Op names follow llm.c's; the fused classifier
# writes dlogits in forward.
LAYER_FORWARD = ("layernorm_forward", "matmul_forward", "attention_forward", "matmul_forward",
                 "residual_forward", "layernorm_forward", "matmul_forward", "gelu_forward",
                 "matmul_forward", "residual_forward")
LAYER_BACKWARD = ("matmul_backward", "gelu_backward", "matmul_backward", "layernorm_backward",
                  "matmul_backward", "attention_backward", "matmul_backward", "layernorm_backward")
NUM_PARAM_TENSORS = 16              # one adamw op per parameter tensor


def expected_step(step, num_layers):
    forward = node("gpt2_forward",
                   node("encoder_forward"),
                   *(node(f"Layer {l}", *map(node, LAYER_FORWARD)) for l in range(num_layers)),
                   node("layernorm_forward"), node("matmul_forward"), node("fused_classifier"))
    backward = node("gpt2_backward",
                    node("matmul_backward"), node("layernorm_backward"),
                    *(node(f"Layer {l}", *map(node, LAYER_BACKWARD))
                      for l in reversed(range(num_layers))),
                    node("encoder_backward"))
    grad_norm = node("gpt2_calculate_grad_norm", node("global_norm"))
    update = node("gpt2_update", *[node("adamw")] * NUM_PARAM_TENSORS)
    return node(f"Train step {step}", forward, backward, grad_norm, update)


def test_training_step_tree(inject_lib, tmp_path):
    try:
        from gpt2np.backends.numpy.backend import NumpyBackend  # noqa: F401
        from gpt2np.model import GPT2  # noqa: F401
    except ImportError as e:
        pytest.skip(f"gpt2np.model is not importable yet: {e}")
    num_layers = 2
    events, _ = run_traced(f"""
        import numpy as np
        from gpt2np import ranges
        from gpt2np.backends.numpy.backend import NumpyBackend
        from gpt2np.config import GPT2Config
        from gpt2np.model import GPT2
        from gpt2np.train_step import train_step

        cfg = GPT2Config(max_seq_len=8, vocab_size=40, padded_vocab_size=64,
                         num_layers={num_layers}, num_heads=2, channels=16)
        B, T = 2, 8
        model = GPT2(cfg, NumpyBackend(), B, T, seed=0)
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
        ranges.enable(True)           # GPT2NP_NVTX=0 kept construction out of the trace
        for step in (1, 2):
            train_step(model, lambda: (tokens[:, :-1], tokens[:, 1:]), step=step, lr=1e-4)
    """, inject_lib, tmp_path, env_extra={"GPT2NP_NVTX": "0"})
    (trees,) = range_trees(events).values()
    expected = [expected_step(1, num_layers), expected_step(2, num_layers)]
    assert render(trees) == render(expected)
    assert trees == expected


# ---- the injection library itself and the in-process API -----------------------------------------

def test_inject_abi_matches_nvtx_headers(tmp_path):
    """inject.c restates NVTX constants and layouts; check them against real headers if present."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found")
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    include = next((Path(r) / "include" for r in roots
                    if r and (Path(r) / "include/nvtx3").is_dir()), None)
    if include is None:
        pytest.skip("no nvtx3 headers found (CUDA_HOME/include or /usr/local/cuda/include)")
    done = subprocess.run([gcc, "-fsyntax-only", "-Wall", "-Werror", "-DINJECT_CHECK_HEADERS",
                           f"-I{include}", str(INJECT_SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class Recorder:
    def __init__(self):
        self.calls = []

    def on_push(self, name, detail=None):
        self.calls.append(("push", name, ranges.current_stack()))

    def on_pop(self, name):
        self.calls.append(("pop", name, ranges.current_stack()))


def test_listeners_and_current_stack_without_nvtx():
    was_on = ranges.enabled()
    ranges.enable(False)
    recorder = Recorder()
    ranges.add_listener(recorder)
    try:
        seen_in_thread = []
        with ranges.range("outer"):
            with ranges.range("inner"):
                assert ranges.current_stack() == ("outer", "inner")
                thread = threading.Thread(
                    target=lambda: seen_in_thread.append(ranges.current_stack()))
                thread.start()
                thread.join()
        assert seen_in_thread == [()]           # the stack is per thread
        assert ranges.current_stack() == ()
        assert recorder.calls == [
            ("push", "outer", ("outer",)),
            ("push", "inner", ("outer", "inner")),
            ("pop", "inner", ("outer", "inner")),
            ("pop", "outer", ("outer",)),
        ]
    finally:
        ranges.remove_listener(recorder)
        ranges.enable(was_on)
    recorder.calls.clear()
    ranges.enable(False)
    try:
        with ranges.range("unseen"):
            assert ranges.current_stack() == ()     # fully off: nothing tracked
    finally:
        ranges.enable(was_on)
    assert recorder.calls == []


def test_failing_listener_leaves_no_range_open():
    class Broken:
        def on_push(self, name, detail=None):
            raise RuntimeError("listener failed")

        def on_pop(self, name):
            pass

    broken = Broken()
    ranges.add_listener(broken)
    try:
        with pytest.raises(RuntimeError):
            with ranges.range("x"):
                pass
    finally:
        ranges.remove_listener(broken)
    assert ranges.current_stack() == ()
