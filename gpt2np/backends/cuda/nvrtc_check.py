"""Compile every kernels/*.cu for several GPU architectures without a GPU; report register spills.

Two independent compiles per file, architecture and build (BUILDS: fp32, and bf16
with -DGPT2NP_BF16):
  nvrtc: NVRTC (the nvidia-cuda-nvrtc wheel, through cupy_backends' binding) with exactly the
         options cupy.RawModule uses at run time: CuPy's include paths and -std around our
         runtime_cupy.nvrtc_options(), then -ftz=true, -arch=sm_XX and
         --device-as-default-execution-space (CuPy's public compile path needs a device to pick
         the architecture, so we assemble the same list ourselves), plus --ptxas-options=-v.
  nvcc:  nvcc -cubin -arch=sm_XX -Xptxas -v with the same language options.
ptxas's report gives registers, stack and spill bytes per kernel; a spill is a failure.

    python -m gpt2np.backends.cuda.nvrtc_check                    # every file, sm_75 sm_80 sm_90
    python -m gpt2np.backends.cuda.nvrtc_check --arch 90 attention --no-nvcc --build bf16
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gpt2np.backends.cuda.backend import BF16_OPTIONS, KERNEL_FILES
from gpt2np.backends.cuda.runtime_cupy import nvrtc_options
from gpt2np.errors import ArgumentParser, BadInput, integer, tool
from gpt2np.paths import KERNEL_DIR

ARCHS = ("75", "80", "90")
# the two builds of every kernel file (kernels/common.cuh: floatX float, or __nv_bfloat16)
# -> their extra options
BUILDS = {"fp32": (), "bf16": BF16_OPTIONS}


class KernelCompileError(RuntimeError):
    """A kernel file failed to compile; the message holds the compiler log."""


@dataclass(frozen=True)
class KernelReport:
    """ptxas's resource report for one kernel of one file for one architecture."""
    tool: str          # "nvrtc" or "nvcc"
    file: str          # stem, e.g. "attention"
    arch: str          # e.g. "sm_90"
    kernel: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    build: str = "fp32"   # BUILDS

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def cupy_nvrtc_options(arch):
    """The full NVRTC option list cupy.RawModule(code, options=nvrtc_options(...)) compiles with on
    an sm_<arch> device (CuPy 13/14: assemble_cupy_compiler_options, then _compile_with_cache_cuda
    and _compile_using_nvrtc append -ftz=true, -arch and --device-as-default-execution-space)."""
    from cupy._core.core import assemble_cupy_compiler_options
    options = assemble_cupy_compiler_options(nvrtc_options(KERNEL_DIR))
    return tuple(options) + ("-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")


def compile_nvrtc(stem, arch, ptxas_verbose=True, build="fp32"):
    """NVRTC-compile kernels/<stem>.cu (its `build`) for sm_<arch> -> (cubin
    bytes, compiler log)."""
    from cupy_backends.cuda.libs import nvrtc
    path = KERNEL_DIR / f"{stem}.cu"
    options = cupy_nvrtc_options(arch) + BUILDS[build] + (("--ptxas-options=-v",) if ptxas_verbose
                                                          else ())
    program = nvrtc.createProgram(path.read_text(), str(path), (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(f"{path}: NVRTC failed for sm_{arch}, {build} build "
                                     f"({error}):\n{log}") from None
        return nvrtc.getCUBIN(program), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def find_nvcc():
    """Path of nvcc ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin) or None."""
    candidates = [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH")
                  if v in os.environ]
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def compile_nvcc(stem, arch, nvcc=None, build="fp32"):
    """nvcc -cubin kernels/<stem>.cu (its `build`) for sm_<arch> with ptxas -v -> the ptxas log."""
    nvcc = nvcc or find_nvcc()
    path = KERNEL_DIR / f"{stem}.cu"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "-ftz=true", *nvrtc_options(KERNEL_DIR),
               *BUILDS[build], "-Xptxas", "-v", "-o", os.path.join(tmp, f"{stem}.cubin"), str(path)]
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelCompileError(f"{path}: nvcc failed for sm_{arch}, {build} build:\n"
                                 f"{result.stderr}{result.stdout}")
    return result.stderr + result.stdout


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log, tool, stem, build="fp32"):
    """ptxas -v output -> [KernelReport] (one per 'Compiling entry function')."""
    reports, current = [], None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = {"kernel": m.group(1), "arch": m.group(2), "registers": 0, "stack": 0,
                       "stores": 0, "loads": 0}
            reports.append(current)
            continue
        if current is None:
            continue
        m = _PROPS.search(line)
        if m:
            current["stack"], current["stores"], current["loads"] = map(int, m.groups())
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
    return [KernelReport(tool, stem, r["arch"], r["kernel"], r["registers"], r["stack"],
                         r["stores"], r["loads"], build) for r in reports]


def check(files=KERNEL_FILES, archs=ARCHS, use_nvcc=True, jobs=2, builds=tuple(BUILDS)):
    """Compile every file in every build for every arch with NVRTC (and nvcc when
    found) -> [KernelReport].

    Raises KernelCompileError on the first failed compile. NVRTC and nvcc run `jobs` at a time.
    """
    tasks = [(stem, arch, build) for stem in files for arch in archs for build in builds]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        logs = list(pool.map(lambda task: compile_nvrtc(task[0], task[1], build=task[2])[1], tasks))
    reports = [r for (stem, _, build), log in zip(tasks, logs)
               for r in parse_ptxas(log, "nvrtc", stem, build)]
    nvcc = find_nvcc() if use_nvcc else None
    if nvcc:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            logs = list(pool.map(lambda task: compile_nvcc(task[0], task[1], nvcc=nvcc,
                                                           build=task[2]), tasks))
        reports += [r for (stem, _, build), log in zip(tasks, logs)
                    for r in parse_ptxas(log, "nvcc", stem, build)]
    return reports


@tool
def main(argv=None):
    """Build the kernels and report their resources: 1 if a build fails or spills, 2 on bad
    flags (one line)."""
    parser = ArgumentParser(prog="python -m gpt2np.backends.cuda.nvrtc_check",
                            description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*",
                        help=f"kernel files (stems) to check (default: {' '.join(KERNEL_FILES)})")
    parser.add_argument("--arch", action="append",
                        help="compute capability, e.g. 90 (repeatable; default 75 80 90)")
    parser.add_argument("--no-nvcc", action="store_true", help="only NVRTC")
    parser.add_argument("--build", action="append", choices=tuple(BUILDS),
                        help="fp32 or bf16 (repeatable; default both)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc compiles")
    args = parser.parse_args(argv)
    unknown = [f for f in args.files if f not in KERNEL_FILES]
    if unknown:
        raise BadInput(f"unknown kernel file(s) {', '.join(unknown)}: expected stems of "
                       f"{KERNEL_DIR}/*.cu, {', '.join(KERNEL_FILES)}")
    integer(1).check("--jobs", args.jobs, "the parallel nvcc compiles")
    for arch in args.arch or ():
        if not re.fullmatch(r"\d{2,3}[af]?", arch):        # sm_XX: 75, 90, 90a, 100f
            raise BadInput(f"--arch {arch}: expected a compute capability such as "
                           "75, 80, 90 or 90a")
    try:
        reports = check(tuple(args.files) or KERNEL_FILES, tuple(args.arch or ARCHS),
                        not args.no_nvcc, args.jobs, tuple(args.build or BUILDS))
    except KernelCompileError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{'tool':6} {'file':16} {'build':5} {'arch':6} {'kernel':36} {'regs':>4} {'stack':>5} "
          f"{'spill st/ld':>11}")
    for r in reports:
        print(f"{r.tool:6} {r.file:16} {r.build:5} {r.arch:6} {r.kernel:36} {r.registers:4d} "
              f"{r.stack_bytes:5d} "
              f"{r.spill_stores:5d}/{r.spill_loads:<5d}{'  SPILLS' if r.spills else ''}")
    spilled = [r for r in reports if r.spills]
    if spilled:
        print(f"nvrtc_check: {len(spilled)} kernel build(s) spill registers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
