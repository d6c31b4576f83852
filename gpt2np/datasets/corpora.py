"""FineWeb's samples -> llm.c token shards, as llm.c's dev/data/fineweb.py makes them.

    gpt2np prepare fineweb --shards 10        # edu_fineweb_val_000000.bin, ..._train_000001.bin
    gpt2np prepare fineweb -t classic -v 100B # fineweb_val_000000.bin, ... of FineWeb's 100BT
    gpt2np prepare fineweb --source docs.parquet --shard-size 1000000   # a local copy (or jsonl)

-t/--type and -v/--version are llm.c's: FineWeb-Edu (`edu`, HuggingFaceFW/fineweb-edu, shards
edu_fineweb_*) or FineWeb (`classic`, HuggingFaceFW/fineweb, shards fineweb_*), its 10B- or
100B-token sample (sample-10BT, sample-100BT). The default here is edu 10B, the data of llm.c's
GPT-2 reproductions (llm.c's script defaults to classic).

Documents come from the Hugging Face Hub through `datasets` (streamed: only what the shards need is
read; `pip install 'gpt2np[data]'`), or from local parquet/jsonl files with a `text` field
(--source; a row or line without a text string is refused, naming it). Each document is
<|endoftext|> + its GPT-2 tokens (tiktoken, in --workers processes), and the token stream is cut
into shards of exactly --shard-size tokens (llm.c: 100M; the last shard holds the rest), a document
running over a shard's end continuing in the next. Shard 0 is the val split: FineWeb's first
shard_size tokens as in llm.c's fineweb.py. The rest are train shards. TinyStories is
tinystories.py's, with the same tokenizing processes.

Resumable: a shard is written atomically, then `<name>_progress.json` records how far the documents
are done (documents consumed, the tokens carried into the next shard). Run again and finished shards
are skipped, the documents they used are skipped untokenized, and the work goes on from the first
missing shard; a larger --shards adds shards. A progress file from other settings (source, sample,
shard size) is refused in one line. Ctrl-C ends the run and its tokenizing processes at once
(tokenizing_pool), in one line; a rerun resumes.
"""
import glob
import itertools
import json
import multiprocessing
import os
import signal
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from gpt2np.datasets.data import DataError, write_shard
from gpt2np.fileio import atomic_write
from gpt2np.formats.tokenizer import TOKENIZER_BIN, get_encoding, write_tokenizer_bin
from gpt2np.progress import progress

SHARD_SIZE = 100_000_000          # llm.c's shard size in tokens
STREAM = "all"                    # the progress file's name for the one token stream


@dataclass(frozen=True)
class Corpus:
    """A dataset on the Hub: id, config, the split whose stream is cut into shards (val is its
    first shard)."""
    name: str                     # shard file prefix
    hub_id: str
    config: str | None
    train_split: str


# llm.c's fineweb.py -t (type) and -v (version): type -> (shard prefix, Hub id); version -> the
# Hub config
FINEWEB_TYPES = {"edu": ("edu_fineweb", "HuggingFaceFW/fineweb-edu"),
                 "classic": ("fineweb", "HuggingFaceFW/fineweb")}
FINEWEB_VERSIONS = {"10B": "sample-10BT", "100B": "sample-100BT"}
FINEWEB_DEFAULT = ("edu", "10B")


def fineweb_corpus(kind=FINEWEB_DEFAULT[0], version=FINEWEB_DEFAULT[1]) -> Corpus:
    """FineWeb (`classic`) or FineWeb-Edu (`edu`), its 10B or 100B sample."""
    name, hub_id = FINEWEB_TYPES[kind]
    return Corpus(name, hub_id, FINEWEB_VERSIONS[version], "train")


class NoDocuments(DataError):
    """A document stream that holds no document at all (an empty source)."""


class OfflineError(OSError):
    """The Hub cannot be reached or `datasets` is missing: one line saying what to do."""


# ---- documents ---------------------------------------------------------------------------------
def source_files(pattern) -> list:
    """The files of --source (a glob, or one file's name), sorted; DataError naming --source when
    there are none."""
    matches = sorted(glob.glob(str(pattern))) or ([str(pattern)] if Path(pattern).exists() else [])
    files = [f for f in matches if Path(f).is_file()]
    if not files and matches:
        what = ("is a folder" if matches == [str(pattern)]
                else f"matches only folders ({len(matches)})")
        raise DataError(f"--source {pattern}: {what}; expected parquet/jsonl files (a glob such as "
                        f"'DIR/*.parquet')")
    if not files:
        raise DataError(f"--source {pattern}: no such file")
    return files


def local_documents(pattern):
    """Texts (the `text` field) of the local .parquet / .jsonl / .json files matching pattern, in
    sorted order."""
    return itertools.chain.from_iterable(file_documents(Path(f)) for f in source_files(pattern))


def open_parquet(path):
    """pyarrow's ParquetFile of a --source file whose `text` column holds strings; DataError naming
    the file."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install 'gpt2np[data]')"
                          ) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:      # pyarrow's errors (ArrowInvalid, ...): a file that is not parquet
        reason = " ".join(str(e).split())[:200]
        raise DataError(f"{path}: not a readable parquet file ({reason})") from None
    schema = parquet.schema_arrow
    if "text" not in schema.names:
        raise DataError(f"{path}: no `text` column (columns: {', '.join(schema.names)})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: its `text` column holds {kind}, not strings")
    return parquet


def file_documents(path):
    """The texts of one --source file (parquet rows or jsonl lines); DataError naming the file and
    the row or line that has no text."""
    if path.suffix == ".parquet":
        row = 0
        for batch in open_parquet(path).iter_batches(columns=["text"], batch_size=1024):
            texts = batch.column(0).to_pylist()
            if None in texts:
                raise DataError(f"{path}: row {row + texts.index(None)} (counting from 0): its "
                                f"`text` is null, not a string")
            row += len(texts)
            yield from texts
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start}): "
                                f"not a jsonl file with a `text` field") from None
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{number}: not a json line with a `text` field ({e})"
                                ) from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: its `text` is a {type(text).__name__}, not a "
                                f"string")
            yield text


def count_documents(pattern) -> int:
    """The documents of --source's files: parquet rows (from the files' metadata) and non-blank
    jsonl lines."""
    total = 0
    for name in source_files(pattern):
        if Path(name).suffix == ".parquet":
            total += open_parquet(Path(name)).metadata.num_rows
        else:
            with open(name, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout=5.0) -> bool:
    """Whether a TCP connection to the Hub's host opens within timeout (else `datasets` retries for
    half a minute before failing)."""
    url = urlsplit(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def hub_documents(corpus: Corpus, split, cache=None):
    """Texts of a split of a Hub dataset, streamed through `datasets`; OfflineError when it cannot
    be reached."""
    try:
        import datasets
    except ImportError:
        raise OfflineError(f"prepare {corpus.hub_id}: downloading needs `datasets` (pip install "
                           f"'gpt2np[data]'), or give --source FILE (a local parquet/jsonl copy)"
                           ) from None
    if not hub_reachable():
        raise OfflineError(f"cannot reach the Hugging Face Hub ({hub_endpoint()}) to read "
                           f"{corpus.hub_id} (offline?); give --source FILE with a local "
                           f"parquet/jsonl copy")
    try:
        stream = datasets.load_dataset(corpus.hub_id, name=corpus.config, split=split,
                                       streaming=True, cache_dir=str(cache) if cache else None)
        iterator = iter(stream)
        first = next(iterator)
    except Exception as e:      # the Hub's errors come in many types (HTTP, connection, offline)
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise OfflineError(f"cannot read {corpus.hub_id} ({corpus.config or 'default'}, {split}) "
                           f"from the Hugging Face Hub (offline?): {reason}; give --source FILE "
                           f"with a local parquet/jsonl copy") from None
    yield first["text"]
    for row in iterator:
        yield row["text"]


# ---- tokenizing in processes ------------------------------------------------------------------
worker_encoding = None            # a tokenizing process's tiktoken Encoding (set by init_worker)


def init_worker(bpe_dir):
    """A tokenizing process's start: it ignores SIGINT (a Ctrl-C to the process group is the
    parent's to handle: it terminates the pool) and loads the tokenizer once."""
    global worker_encoding
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_encoding = get_encoding(bpe_dir)


def tokenize(text):
    """<|endoftext|> + the document's tokens, uint16 (llm.c's tokenize), in a tokenizing process."""
    ids = worker_encoding.encode_ordinary(text)
    tokens = np.empty(len(ids) + 1, np.uint16)
    tokens[0] = worker_encoding.eot_token
    tokens[1:] = ids
    return tokens


@contextmanager
def tokenizing_pool(workers, bpe_dir):
    """A multiprocessing Pool of `workers` tokenizing processes (forked where the platform can),
    terminated on the way out. Ctrl-C interrupts only the parent: a worker that died of it could
    hold the pool's queue lock, and terminating the pool would then wait for that lock forever."""
    fork = "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if fork else None)
    # SIGINT stays blocked while the workers start (they inherit the mask), so none dies of it
    # before init_worker ignores it; a Ctrl-C meanwhile reaches the parent when the mask is restored
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = context.Pool(workers, initializer=init_worker, initargs=(bpe_dir,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with pool:                    # Pool.__exit__ terminates the workers
        yield pool


def default_workers(workers=None) -> int:
    """--workers, or half the CPUs."""
    return workers or max(1, (os.cpu_count() or 2) // 2)


# ---- shards ------------------------------------------------------------------------------------
def shard_path(out_dir, name, index):
    """Shard `index`'s file: the val split is shard 0, the others train."""
    split = "val" if index == 0 else "train"
    return Path(out_dir) / f"{name}_{split}_{index:06d}.bin"


def progress_path(out_dir, name):
    return Path(out_dir) / f"{name}_progress.json"


def load_progress(path, settings):
    """The progress file's state, or a new one; DataError when it was written with other
    settings."""
    if not path.is_file():
        return {"settings": settings, "streams": {}}
    try:
        state = json.loads(path.read_text())
        streams = state["streams"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{path}: not a progress file of gpt2np prepare; remove it to start over"
                        ) from None
    theirs = state.get("settings")
    if theirs != settings:
        raise DataError(f"{path}: written with other settings ({theirs}) than this run's "
                        f"({settings}); use another --output-dir, or remove the folder's shards "
                        f"and this file to start over")
    return {"settings": settings, "streams": streams}


def save_progress(path, state):
    with atomic_write(path, "w") as f:
        json.dump(state, f)


def skip_done_shards(out_dir, name, done, state_path, max_shards, count):
    """Say which shards a resumed run finds done already, and count their tokens and documents."""
    for index in range(done["shards"]):
        if 0 <= max_shards <= index:
            break
        path = shard_path(out_dir, name, index)
        if not path.is_file():
            raise DataError(f"{path}: missing, though {state_path.name} counts it done; remove "
                            f"{state_path} to start over")
        print(f"{path}: done already", flush=True)
        count((path.stat().st_size - 1024) // 2, 0)
    count(0, done["docs"])


def write_stream(documents, out_dir, name, state, state_path, pool, count, shard_size=SHARD_SIZE,
                 max_shards=-1):
    """Tokenize `documents` into shards 0, 1, ..., at most max_shards (-1: until the documents
    end), resuming from state["streams"][STREAM]. count(tokens, documents) moves the progress bar.
    Returns the paths written."""
    done = state["streams"].get(STREAM, {"shards": 0, "docs": 0, "carry": [], "finished": False})
    written = []
    skip_done_shards(out_dir, name, done, state_path, max_shards, count)
    if done["finished"] or 0 <= max_shards <= done["shards"]:
        return written
    docs = itertools.islice(documents, done["docs"], None)   # those in finished shards: skipped

    def pieces():
        """(tokens, documents consumed once they are in): the carried rest of a document first,
        then documents."""
        consumed = done["docs"]
        if done["carry"]:
            yield np.asarray(done["carry"], np.uint16), consumed
        for tokens in pool.imap(tokenize, docs, chunksize=16):
            consumed += 1
            yield tokens, consumed

    def flush(n):
        path = shard_path(out_dir, name, done["shards"])
        write_shard(path, buffer[:n])
        written.append(path)
        print(f"wrote {path} ({n:,} tokens)", flush=True)

    buffer = np.empty(shard_size, np.uint16)
    fill, consumed = 0, done["docs"]
    for tokens, now_consumed in pieces():
        count(0, now_consumed - consumed)
        consumed = now_consumed
        at = 0
        while at < len(tokens):
            take = min(shard_size - fill, len(tokens) - at)
            buffer[fill:fill + take] = tokens[at:at + take]
            fill, at = fill + take, at + take
            count(take, 0)
            if fill == shard_size:    # a full shard: written, then recorded (the rest is carried)
                flush(shard_size)
                fill = 0
                done = {"shards": done["shards"] + 1, "docs": consumed,
                        "carry": tokens[at:].tolist(), "finished": False}
                state["streams"][STREAM] = done
                save_progress(state_path, state)
                if 0 <= max_shards <= done["shards"]:
                    return written
    if fill:
        flush(fill)
        done = {"shards": done["shards"] + 1, "docs": consumed, "carry": [], "finished": True}
    elif not done["shards"]:
        raise NoDocuments("no documents")
    else:
        done = dict(done, finished=True)
    state["streams"][STREAM] = done
    save_progress(state_path, state)
    return written


def progress_bar(which, shards, shard_size, source):
    """The bar of a prepare_corpus run and count(tokens, documents) that moves it: in tokens out of
    the shards asked for (--shards N), else in documents out of --source's (no total for the
    Hub's whole sample)."""
    if shards > 0 or not source:
        total = shards * shard_size if shards > 0 else None
        bar = progress(total=total, desc=f"{which} tokens", unit="tok", unit_scale=True)
        return bar, lambda tokens, documents: bar.update(tokens)
    bar = progress(total=count_documents(source), desc=f"{which} documents", unit="doc")
    return bar, lambda tokens, documents: bar.update(documents)


def prepare_corpus(which, out_dir, shards=-1, shard_size=SHARD_SIZE, source=None, workers=None,
                   bpe_dir=None, cache=None, kind=FINEWEB_DEFAULT[0], version=FINEWEB_DEFAULT[1]):
    """Write `which`'s shards (which: "fineweb", of type `kind` and sample `version`, see the
    module docstring) into out_dir; returns the paths written by this call. shards: how many in
    all, val included (-1: all the data). With a --source, kind names the shards and version plays
    no part."""
    corpus = fineweb_corpus(kind, version)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"dataset": which,
                "source": str(Path(source).resolve()) if source else corpus.hub_id,
                "config": None if source else corpus.config, "shard_size": shard_size}
    state_path = progress_path(out_dir, corpus.name)
    state = load_progress(state_path, settings)
    if cache is not None:
        os.environ.setdefault("HF_DATASETS_CACHE", str(cache))
    split = corpus.train_split
    # a local copy is one stream (val = its first shard), as the Hub's train split is
    documents = local_documents(source) if source else hub_documents(corpus, split, cache)
    bar, count = progress_bar(which, shards, shard_size, source)
    written = []
    with tokenizing_pool(default_workers(workers), bpe_dir) as pool, bar:
        try:
            written += write_stream(documents, out_dir, corpus.name, state, state_path, pool, count,
                                    shard_size, max_shards=shards)
        except NoDocuments:
            where = (f"--source {source}: no documents (no jsonl line or parquet row)" if source
                     else f"{corpus.hub_id} ({corpus.config or 'default'}, {split}): no documents")
            raise NoDocuments(f"{where}: nothing to tokenize") from None
    write_tokenizer_once(out_dir, bpe_dir)
    return written


def write_tokenizer_once(out_dir, bpe_dir):
    """gpt2_tokenizer.bin beside the shards, unless it is there already (fineweb's and
    tinystories' preparers)."""
    if not (Path(out_dir) / TOKENIZER_BIN).exists():
        write_tokenizer_bin(Path(out_dir) / TOKENIZER_BIN, get_encoding(bpe_dir))
