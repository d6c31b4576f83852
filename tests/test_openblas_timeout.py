"""OpenBLAS's thread timeout: gpt2np sets it on import, which only works before
NumPy loads OpenBLAS.

With OpenBLAS's default its threads spin after every GEMM and take the cores from the work between
GEMMs, and a CPU step runs a few percent slower. The CPU benches must import gpt2np first (an import
sorter can move NumPy above it unseen), and the numpy backend warns where it cannot.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_TIMING_SCRIPTS = ["bench/cpu_step.py", "bench/norm_in_cache.py"]


def imported_modules(node):
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module.split(".")[0]]
    return []


def numpy_before_gpt2np(body, gpt2np_seen):
    """Line numbers of numpy imports among the statements `body` not preceded by a gpt2np import in
    the same scope or an enclosing one (gpt2np_seen): functions and classes are scopes of their own,
    if/try/with/for blocks are not."""
    bad, _ = _scan(body, gpt2np_seen)
    return bad


def _scan(body, seen):
    bad = []
    for node in body:
        names = imported_modules(node)
        if "numpy" in names and not seen:
            bad.append(node.lineno)
        seen = seen or "gpt2np" in names
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bad += _scan(node.body, seen)[0]
            continue
        for block in (getattr(node, "body", None), *(h.body for h in getattr(node, "handlers", [])),
                      getattr(node, "orelse", None), getattr(node, "finalbody", None)):
            if isinstance(block, list):
                more, seen = _scan(block, seen)
                bad += more
    return bad, seen


@pytest.mark.parametrize("script", CPU_TIMING_SCRIPTS)
def test_cpu_benches_import_gpt2np_before_numpy(script):
    tree = ast.parse((REPO / script).read_text())
    assert numpy_before_gpt2np(tree.body, False) == [], (f"{script}: numpy imported before "
                                                         "gpt2np at these lines")


def test_the_check_finds_numpy_first():
    """The checker itself: numpy first at module level, in a function and under `if __name__` is
    found; gpt2np first is not."""
    bad = ast.parse("import numpy as np\nimport gpt2np\n")
    good = ast.parse("import gpt2np\nimport numpy as np\n\ndef f():\n    import numpy\n")
    inner = ast.parse("import os\n\ndef f():\n    import numpy as np\n    import gpt2np\n")
    main = ast.parse("if __name__ == '__main__':\n    import numpy\n")
    assert numpy_before_gpt2np(bad.body, False) == [1]
    assert numpy_before_gpt2np(good.body, False) == []
    assert numpy_before_gpt2np(inner.body, False) == [4]
    assert numpy_before_gpt2np(main.body, False) == [2]


WARNING = "RuntimeWarning: NumPy was imported before gpt2np"
THREAD_VARIABLES = ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                    "OMP_NUM_THREADS")


def run_snippet(code, **env):
    environ = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, env={**environ, **env}, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def openblas_numpy():
    import numpy as np
    if ("openblas"
        not in str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()):
        pytest.skip("NumPy's BLAS here is not OpenBLAS: there is nothing to warn about")


MAKE_BACKENDS = ("from gpt2np.backends.numpy.backend import NumpyBackend\n"
                 "NumpyBackend(threads=2, fused=False)\nNumpyBackend(threads=2, fused=False)\n")


def test_numpy_backend_warns_once_when_numpy_came_first():
    openblas_numpy()
    stderr = run_snippet("import numpy\nimport gpt2np\n" + MAKE_BACKENDS)
    assert stderr.count(WARNING) == 1, stderr
    assert "OPENBLAS_THREAD_TIMEOUT=4" in stderr
    assert stderr.startswith("<string>:4: "), stderr          # the line that made the first backend


def test_the_warning_names_the_users_line_through_get_backend():
    """The trainer, compare and the profiler make the backend through get_backend: the warning names
    the caller's line, not gpt2np's."""
    openblas_numpy()
    stderr = run_snippet("import numpy\nimport gpt2np\nfrom gpt2np.backends import get_backend\n\n"
                         "get_backend('numpy', threads=2)\n")
    assert stderr.startswith("<string>:5: " + WARNING), stderr


@pytest.mark.parametrize("code, env", [
    ("import gpt2np\nimport numpy\n" + MAKE_BACKENDS, {}),                         # the right order
    # the user set it
    ("import numpy\nimport gpt2np\n" + MAKE_BACKENDS, {"OPENBLAS_THREAD_TIMEOUT": "4"}),
    ("import numpy\nimport gpt2np\nfrom gpt2np.backends.numpy.backend import NumpyBackend\n"
     # one thread: no worker spins
     "NumpyBackend(threads=1, fused=False)\n", {}),
    # OpenBLAS has no workers
    ("import numpy\nimport gpt2np\n" + MAKE_BACKENDS, {"OPENBLAS_NUM_THREADS": "1"}),
    ("import numpy\nimport gpt2np\n" + MAKE_BACKENDS, {"OMP_NUM_THREADS": "1"}),
])
def test_numpy_backend_is_quiet_where_the_timeout_holds_or_cannot_matter(code, env):
    assert WARNING not in run_snippet(code, **env)


def test_gpt2np_first_sets_the_timeout_before_numpy_loads():
    out = subprocess.run([sys.executable, "-c", "import gpt2np, os, sys\n"
                          "print('numpy' in sys.modules, os.environ['OPENBLAS_THREAD_TIMEOUT'], "
                          "gpt2np.OPENBLAS_TIMEOUT_MISSED)"],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items()
                              if k != "OPENBLAS_THREAD_TIMEOUT"}).stdout.split()
    assert out == ["False", "4", "False"]
