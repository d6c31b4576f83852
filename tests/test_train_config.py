"""TrainConfig is the one place for training settings: train.py's flags come from it, and the flag
tables of docs/training.md and docs/multi-gpu.md must list exactly its flags with its defaults, on
the CPU and on a GPU."""
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

import train
from gpt2np.backends import device_traits
from gpt2np.config import TrainConfig, value_type

REPO = Path(__file__).resolve().parent.parent
TRAINING_PAGE, MULTI_GPU_PAGE = REPO / "docs" / "training.md", REPO / "docs" / "multi-gpu.md"
FIELDS_BY_FLAG = {f.metadata["flag"]: f for f in fields(TrainConfig)}
# the pages write llm.c's device-dependent defaults either way
DEVICE_FORMS = [re.compile(r"(?P<cpu>.+) on the CPU, (?P<gpu>.+) on a GPU"),
                re.compile(r"(?P<cpu>.+) \(CPU\), (?P<gpu>.+) \(GPU\)")]


def table(page, section, header):
    """The cells of each row of the first table with this header line under the section heading."""
    lines = page.splitlines()
    start = next(i for i in range(lines.index(section), len(lines)) if lines[i].strip() == header)
    rows = []
    for line in lines[start + 2:]:                     # + 2: the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def flags_in(cell):
    """`-a 1`, `--profile N` -> -a, --profile: the first word of each code span."""
    return re.findall(r"`(-[-\w]+)[^`]*`", cell)


def default_values(text, count):
    """'3e-4, 0 (all)' -> ['3e-4', '0']: one value per flag, remarks in parentheses and
    code quotes dropped."""
    text = re.sub(r"\s*\([^)]*\)", "", text).replace("`", "")
    return [value.strip() for value in re.split(r"[/,]", text)] if text.strip() else []


def matches(f, text, value):
    """Whether the page's word for a default (a number, on/off, a name or the described
    default) is value."""
    if f.metadata["default_text"]:
        return text == f.metadata["default_text"]
    kind = value_type(f)
    if kind is bool or f.metadata["choices"] == (0, 1):       # switches: on/off or 1/0
        kind, text = int, {"on": "1", "off": "0"}.get(text, text)
    try:
        return kind(text) == value if kind in (int, float) else text == value
    except ValueError:
        return False


def device_defaults(f):
    return f.metadata["cpu_gpu"] or (f.default, f.default)


def training_table_problems(page):
    """What is wrong with docs/training.md's flag table (empty: it agrees with TrainConfig)."""
    problems, seen = [], []
    for flag_cell, _, default_cell in table(page, "## Every flag",
                                            "| flag | meaning (llm.c's) | default |"):
        flags = flags_in(flag_cell)
        unknown = [flag for flag in flags if flag not in FIELDS_BY_FLAG]
        if not flags or unknown:
            problems.append(
                f"{flag_cell}: "
                f"{'no flag' if not flags else 'not TrainConfig flags: ' + str(unknown)}")
            continue
        seen += flags
        form = next((m for m in (form.fullmatch(default_cell) for form in DEVICE_FORMS) if m), None)
        cpu_text, gpu_text = (form["cpu"], form["gpu"]) if form else (default_cell, default_cell)
        for device, text, column in (("CPU", cpu_text, 0), ("GPU", gpu_text, 1)):
            values = default_values(text, len(flags))
            if len(values) != len(flags):
                problems.append(f"{flag_cell}: {len(flags)} flags but {device} defaults {values}")
                continue
            for flag, value in zip(flags, values, strict=True):
                f = FIELDS_BY_FLAG[flag]
                if not matches(f, value, device_defaults(f)[column]):
                    problems.append(f"{flag} ({f.name}): the page says {value!r} on the "
                                    f"{device}, TrainConfig has "
                                    f"{f.metadata['default_text'] or device_defaults(f)[column]!r}")
    if sorted(seen) != sorted(set(seen)):
        problems.append("flags listed twice: "
                        f"{sorted({flag for flag in seen if seen.count(flag) > 1})}")
    if set(FIELDS_BY_FLAG) - set(seen):
        problems.append("TrainConfig flags missing from the table: "
                        f"{sorted(set(FIELDS_BY_FLAG) - set(seen))}")
    return problems


def test_training_page_table_is_train_config():
    assert training_table_problems(TRAINING_PAGE.read_text()) == []


@pytest.mark.parametrize("good, bad", [
    ("| 3e-4, 0, 1.0, cosine |", "| 1e-4, 0, 1.0, cosine |"),            # a wrong number
    ("| 3e-4, 0, 1.0, cosine |", "| 3e-4, 0, cosine |"),                 # a value missing
    ("4 / 1024 on a GPU |", "4 / 512 on a GPU |"),                       # a wrong GPU default
    ("| 10 / 5 (CPU)", "| 10 / 6 (CPU)"),                                # a wrong CPU default
    ("first | off |", "first | on |"),                                   # a switch (--overwrite)
    ("| 1337, 1 |", "| 1337, 0 |"),                                      # a 0/1 setting (--shuffle)
    ("| `--nvtx 0` | turn NVTX ranges off | on |", ""),                  # a flag missing
    ("| `-c` |", "| `-C` |"),                                            # not a flag of TrainConfig
    ("| `-n` / `-y` |", "| `-n` / `-n` |"),                              # listed twice
    ("| `B*T*processes` |", "| B*T |"),                                  # a described default
])
def test_training_page_table_check_is_strict(good, bad):
    page = TRAINING_PAGE.read_text()
    assert page.count(good) == 1
    assert training_table_problems(page.replace(good, bad))


def test_multi_gpu_page_table_flags_and_defaults():
    page = MULTI_GPU_PAGE.read_text()
    rows = table(page, "## Flags", "| flag | meaning |")
    assert rows
    for flag_cell, meaning in rows:
        (flag,) = flags_in(flag_cell)
        assert flag in FIELDS_BY_FLAG, f"{flag_cell} is not a TrainConfig flag"
        f = FIELDS_BY_FLAG[flag]
        # `-z 0` | ... (default): the value shown is the default
        if "(default)" in meaning:
            assert matches(f, flag_cell.strip("`").split()[1], f.default), flag_cell
        elif stated := re.search(r"\(default ([^;)]+)", meaning):
            assert matches(f, stated[1], f.default), flag_cell


def other_value(f):
    """A value for the field that is not its default, as its flag writes it."""
    if value_type(f) is bool:
        return True
    if f.metadata["choices"]:
        return next(c for c in f.metadata["choices"] if c != f.default)
    return {int: 1234, float: 0.125, str: f"{f.name}-value"}[value_type(f)]


def test_every_flag_lands_in_its_field():
    assert train.parse_config([]) == TrainConfig()
    for f in fields(TrainConfig):
        value = other_value(f)
        argv = [f.metadata["flag"]] + ([] if value_type(f) is bool else [str(value)])
        assert train.parse_config(argv) == replace(TrainConfig(), **{f.name: value}), argv


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_config(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in FIELDS_BY_FLAG:
        assert f" {flag} " in text
    assert "-t SEQ_LEN sequence length T (default 64 on the CPU, 1024 on a GPU)" in text
    assert "-l LEARNING_RATE learning rate (default 0.0003)" in text


def test_bad_flag_values_are_argparse_errors():
    for argv in (["-k", "step"], ["-y", "2"], ["--device", "tpu"], ["-b", "four"]):
        with pytest.raises(SystemExit) as exit_:
            train.parse_config(argv)
        assert exit_.value.code == 2


def test_device_defaults():
    cpu = TrainConfig().with_device_defaults(device_traits("numpy"))
    gpu = TrainConfig().with_device_defaults(device_traits("cuda"))
    names = ("batch_size", "seq_len", "max_steps", "val_every", "val_max_batches", "sample_every",
             "attention", "fuse")
    # --fuse: gpt2np's
    assert [getattr(cpu, name) for name in names] == [4, 64, 40, 10, 5, 20, "naive", 0]
    assert [getattr(gpu, name) for name in names] == [4, 1024, -1, 20, 20, 20, "flash", 1]
    # the GPU's kernel path at the CPU's sizes
    emu = TrainConfig().with_device_defaults(device_traits("emu"))
    assert [getattr(emu, name) for name in names] == [4, 64, 40, 10, 5, 20, "flash", 1]
    assert all(getattr(TrainConfig(), name) is None for name in names)
    assert {f.name for f in fields(TrainConfig) if f.metadata["cpu_gpu"]} == set(names)
    given = TrainConfig(seq_len=32, max_steps=0).with_device_defaults(device_traits("cuda"))
    assert (given.seq_len, given.max_steps, given.batch_size) == (32, 0, 4)
    # filled once, never overwritten
    assert gpu.with_device_defaults(device_traits("numpy")) == gpu


def test_e_help_says_it_takes_a_hugging_face_folder_or_id():
    """train's -e takes what eval's and sample's take; its help says so (issue 37)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True,
                          text=True)
    text = " ".join(done.stdout.split())
    assert (done.returncode == 0 and "Hugging Face GPT-2 folder" in text
            and "Hub id" in text), text[-500:]
