"""Shared pytest fixtures (generic only), and the signal dispositions every test starts from."""
import os
import signal
from pathlib import Path

# before NumPy, as train.py: OpenBLAS's thread timeout (else the numpy backend warns)
import gpt2np  # noqa: F401

# isort: split
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# pytest started with SIGINT or SIGTERM ignored (under nohup, as `cmd &` in a script, by some CI
# runners) passes that on to every trainer a test runs, here or in a child process, and the trainer
# rightly keeps an inherited SIG_IGN. The signal tests send those signals as a terminal and a
# scheduler would, to a process started with the defaults: so this process takes the defaults (a
# caught SIGINT resets to the default in a child), whatever it was started with.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def data_dir():
    """Folder with tinyshakespeare.txt, gpt2_vocab.bpe, gpt2_encoder.json: env GPT2NP_DATA_DIR
    (.ci/run sets it); tests using it are skipped without it."""
    if not os.environ.get("GPT2NP_DATA_DIR"):
        pytest.skip("GPT2NP_DATA_DIR is not set (the folder with tinyshakespeare.txt and the "
                    "GPT-2 BPE files)")
    path = Path(os.environ["GPT2NP_DATA_DIR"])
    if not path.is_dir():
        pytest.skip(f"GPT2NP_DATA_DIR={path}: no such folder")
    return path
