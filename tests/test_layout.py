"""The structure stays what docs/architecture.md says: every module is in the map and every mapped module
exists, one module computes paths from the package's location, and nothing below train.py reads settings
by llm.c's one-letter flag names."""
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
                     for n, line in enumerate(p.read_text().splitlines(), 1) if single_letter.search(line))
    assert not readers, readers


def test_ci_runs_the_readme_test_command():
    readme = (paths.REPO_ROOT / "README.md").read_text().split("```")[1]
    test_command = next(line for line in readme.splitlines() if "pytest" in line)
    ci = (paths.REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == test_command


def test_backends_have_the_traits_their_names_promise():
    """Code above the backends asks traits (on_gpu, launches_kernels, has_cpu_math, label), never a name: a
    backend's attributes are those device_traits gives for its --device before there is a backend."""
    from gpt2np.backends import TRAITS, device_traits, get_backend
    for device, kwargs in (("cpu", {}), ("cpu", {"precision": "bf16"}), ("emu", {}), ("emu", {"precision": "bf16"})):
        backend, traits = get_backend(device, **kwargs), device_traits(device)
        assert (backend.on_gpu, backend.launches_kernels, backend.has_cpu_math, backend.label) == \
            (traits.on_gpu, traits.launches_kernels, traits.has_cpu_math, traits.label), device
    assert TRAITS["cuda"].on_gpu and TRAITS["cuda"].launches_kernels and not TRAITS["cuda"].has_cpu_math
