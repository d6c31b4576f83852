"""A non-editable install is self-contained: the wheel carries kernels/*.cu, the emulator's headers
and the numpy backend's C sources (backends/numpy/csrc/*.c), and the CUDA backend finds its kernels
inside the installed package (checked by running a kernel from an unpacked wheel on the CPU
emulator, far from the source tree); the numpy backend builds its C loops from there."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    # a copy: no build/ left in the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("gpt2np", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "-w",
                            str(out), "--no-deps",
                            "--no-build-isolation", "-q"], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip().splitlines()[-1:]}")
    return next(out.glob("gpt2np-*.whl"))


def test_wheel_carries_every_kernel_and_emulator_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources and all(f"gpt2np/kernels/{name}" in names for name in sources)
    emu = REPO / "gpt2np" / "backends" / "cuda" / "emu"
    headers = [p.relative_to(REPO).as_posix() for p in emu.rglob("*") if p.is_file()]
    assert headers and all(h in names for h in headers)
    csrc_dir = REPO / "gpt2np" / "backends" / "numpy" / "csrc"
    csrc = [p.relative_to(REPO).as_posix() for p in csrc_dir.glob("*.c")]
    assert csrc and all(c in names for c in csrc)
    modules = [p.relative_to(REPO).as_posix() for p in (REPO / "gpt2np").rglob("*.py")]
    assert all(m in names for m in modules)


def test_unpacked_wheel_runs_a_kernel_without_the_source_tree(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = """
import numpy as np
import gpt2np
from gpt2np.backends.cuda import backend
from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
assert backend.KERNEL_DIR.parent.parent == __import__("pathlib").Path(gpt2np.__file__).parent.parent
be = CudaBackend(EmuRuntime())
x = np.linspace(-3, 3, 64, dtype=np.float32)
out = be.zeros(64)
be.gelu_forward(out, be.from_host(x))
ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
np.testing.assert_allclose(be.to_host(out), ref, atol=1e-6)
print(backend.KERNEL_DIR)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin:/usr/local/bin",
                              "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == site / "gpt2np" / "kernels"


def test_unpacked_wheel_builds_the_numpy_backends_c_loops(wheel, tmp_path):
    """cpu_kernels compiles csrc/*.c from inside the installed package (where a compiler exists)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = """
import gpt2np
from gpt2np.backends.numpy import cpu_kernels
assert cpu_kernels.CSRC.parent.parent.parent == __import__("pathlib").Path(gpt2np.__file__).parent
if cpu_kernels.compiler() is not None:
    assert cpu_kernels.load() is not None
print(cpu_kernels.CSRC)
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin:/usr/local/bin",
                              "HOME": str(tmp_path), "GPT2NP_CPU_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == site / "gpt2np" / "backends" / "numpy" / "csrc"
