"""The structure stays what docs/architecture.md says: every module is in the map and every mapped
module exists, one module computes paths from the package's location, and nothing below train.py
reads settings by llm.c's one-letter flag names."""
import re
from pathlib import Path

from gpt2np import paths

PACKAGE = paths.PACKAGE_DIR
DOC = paths.REPO_ROOT / "docs" / "architecture.md"


def package_modules():
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "emu" not in p.relative_to(PACKAGE).parts[:-1])


def mapped_names():
    """File names in the doc's tree (the first code block), e.g. 'model.py', 'runtime_cupy.py'."""
    tree = DOC.read_text().split("```")[1]
    return set(re.findall(r"\b([a-z0-9_]+\.py)\b", tree))


def test_every_module_is_in_the_architecture_map_and_back():
    modules = package_modules()
    names = {Path(m).name for m in modules}
    missing = sorted(m for m in modules if Path(m).name not in mapped_names())
    assert not missing, f"modules not in docs/architecture.md: {missing}"
    stale = sorted(mapped_names() - names - {"train.py", "__init__.py"})
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
    for package in ("backends", "backends/cuda", "profiling"):
        assert (PACKAGE / package / "__init__.py").is_file(), package


def test_only_paths_py_works_out_locations_from_the_package():
    own_location = re.compile(r"(?<![\w.])__file__")
    users = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                   if own_location.search(p.read_text()))
    assert users == ["paths.py"]


def test_no_single_letter_flag_reads_below_train_py():
    single_letter = re.compile(r"\bargs\.[a-z]\b")
    readers = sorted(f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py")
                     for n, line in enumerate(p.read_text().splitlines(),
                                              1) if single_letter.search(line))
    assert not readers, readers


def test_ci_runs_the_readme_test_command():
    readme = (paths.REPO_ROOT / "README.md").read_text().split("```")[1]
    test_command = next(line for line in readme.splitlines() if "pytest" in line)
    ci = (paths.REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == test_command


def test_backends_have_the_traits_their_names_promise():
    """Code above the backends asks traits (on_gpu, launches_kernels, has_cpu_math, label), never a
    name: a backend's attributes are those device_traits gives for its --device before
    there is a backend."""
    from gpt2np.backends import TRAITS, device_traits, get_backend
    for device, kwargs in (("cpu", {}), ("cpu", {"precision": "bf16"}), ("emu", {}),
                           ("emu", {"precision": "bf16"})):
        backend, traits = get_backend(device, **kwargs), device_traits(device)
        assert (backend.on_gpu, backend.launches_kernels, backend.has_cpu_math, backend.label) == \
            (traits.on_gpu, traits.launches_kernels, traits.has_cpu_math, traits.label), device
    assert (TRAITS["cuda"].on_gpu and TRAITS["cuda"].launches_kernels
            and not TRAITS["cuda"].has_cpu_math)


def package_trees():
    """{path relative to the package: its parsed module} of every module of gpt2np."""
    import ast
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text())
            for p in PACKAGE.rglob("*.py")}


# the optional or heavy dependencies a function may import where it needs them (not at
# the top of a module)
LATE_IMPORTS = {"cupy", "cupy_backends", "torch", "matplotlib", "datasets", "mpi4py", "safetensors",
                "nvmath", "huggingface_hub", "pyarrow", "transformers", "platformdirs", "cupti",
                "nvtx", "ncu_report", "resource", "nvidia", "gpt2np.train.trainer"}


def test_imports_are_at_the_top_but_for_optional_dependencies():
    """A module says what it depends on at its top; a function imports only an optional dependency
    (or, in gpt2np train's command, the trainer, so that --help answers at once)."""
    import ast
    late = []
    for path, tree in package_trees().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                            [a.name for a in node.names]
                        late += [f"{path}:{node.lineno} {n}" for n in names
                                 if n.split(".")[0] not in LATE_IMPORTS and n not in LATE_IMPORTS]
    assert not late, late


def test_no_private_name_is_imported_from_another_module():
    import ast
    private = [f"{path}:{node.lineno} {node.module}.{a.name}"
               for path, tree in package_trees().items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) for a in node.names if a.name.startswith("_")]
    assert not private, private


def test_no_function_is_over_80_lines():
    import ast
    long = [f"{path}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1})"
            for path, tree in package_trees().items() for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef,
                               ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno >= 80]
    assert not long, long


def test_device_names_are_compared_only_inside_the_backends():
    """Code above the backends asks traits (test_backends_have_the_traits_their_names_promise)."""
    check = re.compile(
        r"""(backend|\bbe)\.name\s*(==|!=|in)\s*|name\s*==\s*["'](cuda|emu|numpy)["']""")
    found = [f"{p.relative_to(PACKAGE)}:{k}" for p in PACKAGE.rglob("*.py")
             if "backends" not in p.parts
             for k, line in enumerate(p.read_text().splitlines(), 1) if check.search(line)]
    assert not found, found


def test_no_date_stamps_in_code():
    """Comments say what and why, not when: dates belong in CHANGELOG.md and the
    benchmark tables."""
    date = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
    root = paths.REPO_ROOT
    found = [f"{p.relative_to(root)}:{k}" for folder in ("gpt2np", "kernels", "bench", "tests")
             for p in (root / folder).rglob("*") if p.suffix in (".py", ".cu", ".cuh", ".c", ".h",
                                                                 ".sh")
             for k, line in enumerate(p.read_text(errors="replace").splitlines(),
                                      1) if date.search(line)]
    assert not found, found
