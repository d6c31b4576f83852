"""Shared pytest fixtures (generic only)."""
import os
from pathlib import Path

import gpt2np  # noqa: F401  (before NumPy, as train.py: OpenBLAS's thread timeout; else the numpy backend warns)

# isort: split
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_dir():
    """Folder with tinyshakespeare.txt, gpt2_vocab.bpe, gpt2_encoder.json (env GPT2NP_DATA_DIR,
    default <repo>/../shared/data); tests using it are skipped when it does not exist."""
    path = Path(os.environ.get("GPT2NP_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"data folder {path} not found (set GPT2NP_DATA_DIR)")
    return path
