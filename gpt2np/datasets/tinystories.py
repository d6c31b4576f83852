"""TinyStories -> llm.c's two token files, as its dev/data/tinystories.py makes them.

    gpt2np prepare tinystories                          # downloads TinyStories_all_data.tar.gz (1.5 GB), once
    gpt2np prepare tinystories --source 'DIR/*.json'    # the json files of an unpacked local copy

The data is TinyStories' TinyStories_all_data.tar.gz: json files (data00.json .. data49.json), each a list of
objects with a "story". The first file by name is the val split, the others train. Each file's stories are
shuffled with Python's random.Random(1337 + the file's index within its split), stripped of surrounding whitespace
and written as <|endoftext|> + their GPT-2 tokens, a split's files one after another in name order (llm.c's script
takes them in the order its worker processes finish, which changes from run to run). Written: TinyStories_val.bin
and TinyStories_train.bin (llm.c token files, magic 20240520) and gpt2_tokenizer.bin.
"""
import json
import multiprocessing
import os
import random
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from gpt2np.datasets.data import DataError, write_shard

TARBALL_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"
TARBALL = "TinyStories_all_data.tar.gz"
UNPACKED = "TinyStories_all_data"
NAME = "TinyStories"
SHUFFLE_SEED = 1337                # llm.c's: file k of a split is shuffled with random.Random(1337 + k)
# tarfile's "data" filter where this Python has it (3.10.12+, 3.11.4+); the members are flattened to their names anyway
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def story_files(source=None, cache=None, timeout=10):
    """The json files, sorted by name: --source's, or those of the tarball, downloaded into and unpacked in cache."""
    if source:
        from gpt2np.datasets.corpora import source_files
        files = source_files(source)
    else:
        folder = Path(cache) / UNPACKED
        if not folder.is_dir():
            from gpt2np.datasets.fetch import FetchError, download
            try:
                tarball = download(TARBALL_URL, Path(cache) / TARBALL, timeout=timeout)
            except FetchError as e:
                raise FetchError(f"{e}; give --source 'DIR/*.json' with the json files of a local copy") from None
            _unpack(tarball, folder)
        files = sorted(str(p) for p in folder.rglob("*.json"))
    if len(files) < 2:
        where = f"--source {source}" if source else str(Path(cache) / UNPACKED)
        raise DataError(f"{where}: {len(files)} json file(s); TinyStories needs 2 or more (the first is the val "
                        f"split, the others train)")
    return files


def _unpack(tarball, folder):
    """Unpack the tarball into folder, atomically (a temporary folder renamed), json files only."""
    work = Path(tempfile.mkdtemp(prefix=f".{UNPACKED}-", dir=folder.parent))
    try:
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")]
            for member in members:
                member.name = os.path.basename(member.name)      # flat, and nothing outside the folder
                tar.extract(member, work, **SAFE_EXTRACT)
        os.replace(work, folder)
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{tarball}: cannot unpack ({e}); remove it to download it again") from None
    finally:
        if work.exists():
            import shutil
            shutil.rmtree(work, ignore_errors=True)


_encoding = None


def _init_worker(bpe_dir):
    global _encoding
    from gpt2np.formats.tokenizer import get_encoding
    _encoding = get_encoding(bpe_dir)


def file_tokens(job):
    """(index within its split, path) -> that file's stories shuffled as llm.c's, each EOT + its tokens (uint16)."""
    index, path = job
    try:
        with open(path, encoding="utf-8") as f:
            stories = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a TinyStories json file (a list of objects with a \"story\"): {e}") from None
    if not isinstance(stories, list):
        raise DataError(f"{path}: a json {type(stories).__name__}, not TinyStories' list of stories")
    for k, story in enumerate(stories):
        if not (isinstance(story, dict) and isinstance(story.get("story"), str)):
            raise DataError(f"{path}: item {k} has no \"story\" text")
    random.Random(SHUFFLE_SEED + index).shuffle(stories)
    eot = _encoding.eot_token
    tokens = [t for story in stories for t in (eot, *_encoding.encode_ordinary(story["story"].strip()))]
    return np.asarray(tokens, np.uint16)


def prepare_tinystories(out_dir, source=None, workers=None, bpe_dir=None, cache=None, timeout=10):
    """Write TinyStories_val.bin and TinyStories_train.bin into out_dir (see the module docstring); their paths."""
    files = story_files(source, cache, timeout)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    written = []
    with context.Pool(workers, initializer=_init_worker, initargs=(bpe_dir,)) as pool:
        for split, split_files in (("val", files[:1]), ("train", files[1:])):
            tokens = np.concatenate(pool.map(file_tokens, list(enumerate(split_files))))
            path = out_dir / f"{NAME}_{split}.bin"
            write_shard(path, tokens)
            written.append(path)
    from gpt2np.datasets.corpora import write_tokenizer_once
    write_tokenizer_once(out_dir, bpe_dir)
    return written
