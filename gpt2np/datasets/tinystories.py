"""TinyStories -> llm.c's two token files, as its dev/data/tinystories.py makes them.

    gpt2np prepare tinystories                        # TinyStories_all_data.tar.gz (1.5 GB), once
    gpt2np prepare tinystories --source 'DIR/*.json'  # the json files of an unpacked local copy

The data is TinyStories' TinyStories_all_data.tar.gz: json files (data00.json .. data49.json),
each a list of objects with a "story". The first file by name is the val split, the others train.
Each file's stories are shuffled with Python's random.Random(1337 + the file's index within its
split), stripped of surrounding whitespace and written as <|endoftext|> + their GPT-2 tokens, a
split's files one after another in name order (llm.c's script takes them in the order its worker
processes finish, which changes from run to run). Written: TinyStories_val.bin and
TinyStories_train.bin (llm.c token files, magic 20240520) and gpt2_tokenizer.bin. A split whose
files hold no story is refused. The stories are tokenized by corpora.py's tokenizing_pool: Ctrl-C
ends it at once.
"""
import json
import os
import random
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from gpt2np.datasets import fetch
from gpt2np.datasets.corpora import (
    default_workers,
    source_files,
    tokenize,
    tokenizing_pool,
    write_tokenizer_once,
)
from gpt2np.datasets.data import DataError, write_shard

TARBALL_URL = ("https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
               "TinyStories_all_data.tar.gz")
TARBALL = "TinyStories_all_data.tar.gz"
UNPACKED = "TinyStories_all_data"
NAME = "TinyStories"
SHUFFLE_SEED = 1337                # llm.c's: file k of a split is shuffled by Random(1337 + k)
STORIES_PER_TASK = 64              # stories a tokenizing process takes at a time
# tarfile's "data" filter where this Python has it (3.10.12+, 3.11.4+); the members are flattened
# to their names anyway
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def story_files(source=None, cache=None, timeout=10):
    """The json files, sorted by name: --source's, or those of the tarball, downloaded into and
    unpacked in cache."""
    if source:
        files = source_files(source)
    else:
        folder = Path(cache) / UNPACKED
        if not folder.is_dir():
            try:
                tarball = fetch.download(TARBALL_URL, Path(cache) / TARBALL, timeout=timeout)
            except fetch.FetchError as e:
                raise fetch.FetchError(f"{e}; give --source 'DIR/*.json' with the json files of a "
                                       f"local copy") from None
            unpack(tarball, folder)
        files = sorted(str(p) for p in folder.rglob("*.json"))
    if len(files) < 2:
        where = f"--source {source}" if source else str(Path(cache) / UNPACKED)
        raise DataError(f"{where}: {len(files)} json file(s); TinyStories needs 2 or more (the "
                        f"first is the val split, the others train)")
    return files


def unpack(tarball, folder):
    """Unpack the tarball into folder, atomically (a temporary folder renamed), json files only."""
    work = Path(tempfile.mkdtemp(prefix=f".{UNPACKED}-", dir=folder.parent))
    try:
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")]
            for member in members:
                member.name = os.path.basename(member.name)  # flat, nothing outside the folder
                tar.extract(member, work, **SAFE_EXTRACT)
        os.replace(work, folder)
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{tarball}: cannot unpack ({e}); remove it to download it again") from None
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def file_stories(index, path) -> list:
    """A file's stories, shuffled as llm.c's (index: the file's place in its split) and stripped."""
    try:
        with open(path, encoding="utf-8") as f:
            stories = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a TinyStories json file (a list of objects with a "
                        f"\"story\"): {e}") from None
    if not isinstance(stories, list):
        raise DataError(f"{path}: a json {type(stories).__name__}, not TinyStories' list of "
                        f"stories")
    for k, story in enumerate(stories):
        if not (isinstance(story, dict) and isinstance(story.get("story"), str)):
            raise DataError(f"{path}: item {k} has no \"story\" text")
    random.Random(SHUFFLE_SEED + index).shuffle(stories)
    return [story["story"].strip() for story in stories]


def split_tokens(pool, split, split_files, where) -> np.ndarray:
    """A split's tokens: its files' stories one file after another, each story EOT + its tokens
    (uint16), tokenized by the pool. DataError when the files hold no story."""
    stories = (story for index, path in enumerate(split_files)
               for story in file_stories(index, path))
    tokens = list(pool.imap(tokenize, stories, chunksize=STORIES_PER_TASK))
    if not tokens:
        names = ", ".join(Path(f).name for f in split_files[:3])
        names += ", ..." if len(split_files) > 3 else ""
        raise DataError(f"{where}: the {split} split's file(s) ({names}) hold no stories: nothing "
                        f"to tokenize")
    return np.concatenate(tokens)


def prepare_tinystories(out_dir, source=None, workers=None, bpe_dir=None, cache=None, timeout=10):
    """Write TinyStories_val.bin and TinyStories_train.bin into out_dir (see the module
    docstring); their paths. Both splits are tokenized before either is written: a split without
    stories writes nothing."""
    files = story_files(source, cache, timeout)
    where = f"--source {source}" if source else str(Path(cache) / UNPACKED)
    splits = {"val": files[:1], "train": files[1:]}
    with tokenizing_pool(default_workers(workers), bpe_dir) as pool:
        tokens = {split: split_tokens(pool, split, split_files, where)
                  for split, split_files in splits.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split in splits:
        path = out_dir / f"{NAME}_{split}.bin"
        write_shard(path, tokens[split])
        written.append(path)
    write_tokenizer_once(out_dir, bpe_dir)
    return written
