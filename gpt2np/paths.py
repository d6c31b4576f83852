"""Where things live: the package's own files, and the folder of the user's downloads and shards.

    KERNEL_DIR       kernels/*.cu: beside the package in a source checkout, in a wheel
                     inside it (gpt2np/kernels)
    EMU_HEADERS_DIR  the CPU emulator's shim headers (cuda_emu.h, include/ for <cuda_runtime.h>)
    REPO_ROOT        the folder holding gpt2np/ (the source checkout in an editable install)
    CHECKPOINTS_DIR  checkpoints/ in the current folder: fetched models, tokenizer, BPE files
    DATA_DIR         checkpoints/data in the current folder: prepared token shards
    data_search_dirs()  [(folder, why)] where local data files are looked up, in order

CHECKPOINTS_DIR and DATA_DIR are relative paths: `gpt2np fetch` and `gpt2np prepare` write into
the folder they are run from, the paths they print work as printed there, and `gpt2np train` run
from the same folder finds them.
"""
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
KERNEL_DIR = (PACKAGE_DIR / "kernels" if (PACKAGE_DIR / "kernels").is_dir()
              else REPO_ROOT / "kernels")
EMU_HEADERS_DIR = PACKAGE_DIR / "backends" / "cuda" / "emu"
CHECKPOINTS_DIR = Path("checkpoints")
DATA_DIR = CHECKPOINTS_DIR / "data"
DATA_DIR_ENV = "GPT2NP_DATA_DIR"


def data_search_dirs():
    """[(folder, why_we_look_there)] for local data files (corpus, BPE files), in search order:
    $GPT2NP_DATA_DIR, checkpoints/, checkpoints/data."""
    dirs = [(Path(os.environ[DATA_DIR_ENV]), DATA_DIR_ENV)] if os.environ.get(DATA_DIR_ENV) else []
    return dirs + [(CHECKPOINTS_DIR, "in the current folder"), (DATA_DIR, "in the current folder")]
