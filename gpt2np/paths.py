"""Where things live: the one module that works out paths from the package's own location.

    KERNEL_DIR       kernels/*.cu: beside the package in a source checkout, inside it (gpt2np/kernels) in a wheel
    EMU_HEADERS_DIR  the CPU emulator's shim headers (cuda_emu.h, include/ for <cuda_runtime.h> and friends)
    REPO_ROOT        the folder holding gpt2np/ (the source checkout in an editable install)
    CHECKPOINTS_DIR  where fetched models, the tokenizer and prepared shards go (REPO_ROOT/checkpoints)
    DATA_DIR         prepared token shards (CHECKPOINTS_DIR/data)
    SHARED_DATA_DIR  ../shared/data beside the checkout (tinyshakespeare.txt and the GPT-2 BPE files)
    data_search_dirs()  [(folder, why)] where local data files are looked up, in order
"""
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
KERNEL_DIR = PACKAGE_DIR / "kernels" if (PACKAGE_DIR / "kernels").is_dir() else REPO_ROOT / "kernels"
EMU_HEADERS_DIR = PACKAGE_DIR / "backends" / "cuda" / "emu"
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"
DATA_DIR = CHECKPOINTS_DIR / "data"
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
DATA_DIR_ENV = "GPT2NP_DATA_DIR"


def data_search_dirs():
    """[(folder, why_we_look_there)] for local data files (corpus, BPE files), in search order:
    $GPT2NP_DATA_DIR, ../shared/data, checkpoints/, checkpoints/data."""
    dirs = [(Path(os.environ[DATA_DIR_ENV]), DATA_DIR_ENV)] if os.environ.get(DATA_DIR_ENV) else []
    root = REPO_ROOT                          # read at call time (tests point it at a scratch folder)
    return dirs + [(root.parent / "shared" / "data", "shared data folder"), (root / "checkpoints", "checkpoints"),
                   (root / "checkpoints" / "data", "checkpoints/data")]
