"""HellaSwag: pick the ending of a context the model finds most likely, as llm.c
(dev/data/hellaswag.py) does.

    gpt2np eval hellaswag -e model.bin           # hellaswag_val.jsonl, fetched into the cache
    gpt2np eval hellaswag -e gpt2 -j my.jsonl -m 100    # a local jsonl, the first 100 examples

Each jsonl line has `ctx` (the context), `endings` (4 strings) and `label` (the index
of the right ending).
Each ending is scored as llm.c does: the tokens are ctx's tokens + the tokens of " " + ending, and
only the ending's tokens are scored (the cross-entropy of predicting each of them from what comes
before). acc picks the ending with the lowest summed loss (`pred = sum_loss.argmin()`), acc_norm the
lowest mean loss per ending token (`pred_norm = avg_loss.argmin()`), the number llm.c's trainer logs
as `s:STEP eval:ACC`.

llm.c's own eval file (the starter pack's hellaswag_val.bin, written by its dev/data/hellaswag.py)
is read too: it holds the same tokens, rendered already (read_llmc_evalfile).

Batched on any backend: the 4 rows of an example (and of several examples, B rows a batch) are
padded to the longest row of the batch. A row longer than the model's T + 1 tokens keeps its last
T + 1: its ending whole when the ending has at most T tokens; a longer ending has only its last T
tokens scored, which evaluate() says in a note with the count (long_endings).
"""
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2np.datasets import fetch
from gpt2np.datasets.cache import CachedFile, cached
from gpt2np.errors import is_int
from gpt2np.formats import tokenizer
from gpt2np.progress import progress

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_FILE = CachedFile("hellaswag_val.jsonl", VAL_URL)


@dataclass
class Example:
    """One rendered example: 4 token rows, each with how many of its last tokens are the
    ending, and the label."""
    rows: list
    ending_lens: list
    label: int


@dataclass
class Result:
    """Scores of a set of examples: per-ending summed and mean losses (n, 4), labels (n,)."""
    sum_loss: np.ndarray
    avg_loss: np.ndarray
    labels: np.ndarray

    @property
    def n(self):
        return len(self.labels)

    @property
    def correct(self):
        return int((self.sum_loss.argmin(1) == self.labels).sum())

    @property
    def correct_norm(self):
        return int((self.avg_loss.argmin(1) == self.labels).sum())

    @property
    def acc(self):
        return self.correct / max(self.n, 1)

    @property
    def acc_norm(self):
        return self.correct_norm / max(self.n, 1)


# llm.c's eval file header (data_common.py write_evalfile)
LLMC_EVAL_MAGIC = (20240522).to_bytes(4, "little")


class BadExamples(ValueError):
    """A HellaSwag file that is not one (not UTF-8 text, a bad line, no examples); the
    message names the file."""


def read_examples(path, max_examples=-1):
    """The examples of a HellaSwag jsonl file ({ctx, endings, label} a line); BadExamples
    names the bad line."""
    path = Path(path)
    if path.is_dir():
        raise BadExamples(f"{path}: is a folder; expected a HellaSwag jsonl file")
    examples = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if 0 <= max_examples <= len(examples):
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadExamples(f"{path}:{number}: not UTF-8 text ({e.reason} at byte "
                                  f"{e.start}): not a HellaSwag jsonl file") from None
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                ctx, endings, label = item["ctx"], item["endings"], item["label"]
                # "3" as the Hub's copy writes it is the index 3; int() would also make 1.5 or
                # true an index: not so
                label = int(label) if isinstance(label, str) else label
            except (ValueError, KeyError, TypeError) as e:
                raise BadExamples(f"{path}:{number}: not a HellaSwag line with ctx, "
                                  f"endings, label ({e})") from None
            if (not isinstance(ctx, str) or not isinstance(endings, list) or len(endings) != 4
                    or not all(isinstance(e, str) for e in endings)):
                raise BadExamples(f"{path}:{number}: expected a string ctx, 4 string endings "
                                  "and a label 0..3")
            if not is_int(label) or not 0 <= label < 4:
                raise BadExamples(f"{path}:{number}: label {json.dumps(item['label'])}: expected "
                                  "an integer 0..3 (the index of the right ending)")
            examples.append({"ctx": ctx, "endings": endings, "label": label})
    if not examples:
        raise BadExamples(f"{path}: no HellaSwag examples")
    return examples


def is_llmc_evalfile(path) -> bool:
    """Whether `path` starts as llm.c's eval file does (dev/data/data_common.py
    write_evalfile: magic 20240522)."""
    with open(path, "rb") as f:
        return f.read(4) == LLMC_EVAL_MAGIC


def read_llmc_evalfile(path, max_examples=-1) -> list:
    """The examples of llm.c's HellaSwag eval file (the starter pack's hellaswag_val.bin,
    dev/data/hellaswag.py's output), already rendered: a 256-int32 header (magic, version 1,
    examples, longest example), then per example uint16s: 65535, its size in bytes, its index, the
    label, the number of endings, the context's token count and tokens, then each ending's token
    count and tokens. The same Examples render() makes of the jsonl."""
    raw = Path(path).read_bytes()
    if len(raw) < 1024:
        raise BadExamples(f"{path}: llm.c eval file cut short inside its 1024-byte header")
    header = np.frombuffer(raw[:1024], "<i4")
    if header[1] != 1:
        raise BadExamples(f"{path}: llm.c eval file version {header[1]} (expected 1)")
    stream, count = np.frombuffer(raw[1024:len(raw) - len(raw) % 2], "<u2"), int(header[2])
    examples, pos = [], 0
    for number in range(count if max_examples < 0 else min(count, max_examples)):
        if pos + 6 > len(stream) or pos + int(stream[pos + 1]) // 2 > len(stream):
            raise BadExamples(f"{path}: example {number} of {count} is cut short: truncated file")
        if stream[pos] != 0xFFFF:
            raise BadExamples(f"{path}: example {number}: no start marker at byte "
                              f"{1024 + 2 * pos}: not llm.c's eval layout, or damaged")
        size, label, endings, n_ctx = (int(x) for x in stream[[pos + 1, pos + 3, pos + 4, pos + 5]])
        # llm.c's evalloader asserts both; we score 4 endings
        if endings != 4 or not 0 <= label < 4:
            raise BadExamples(f"{path}: example {number}: {endings} endings, label {label} "
                              "(HellaSwag has 4 endings, label 0-3): damaged")
        example = stream[pos:pos + size // 2]
        try:
            at = 6 + n_ctx
            ctx = example[6:at].tolist()
            if len(ctx) < n_ctx:
                raise IndexError
            rows, lens = [], []
            for _ in range(endings):
                n = int(example[at])
                end = example[at + 1:at + 1 + n].tolist()
                if len(end) < n:
                    raise IndexError
                rows.append(ctx + end)
                lens.append(n)
                at += 1 + n
        except IndexError:
            at = -1
        if at != size // 2 or size % 2:
            raise BadExamples(f"{path}: example {number}: its token counts do not fit its "
                              f"{size} bytes: damaged")
        # GPT-2's tokens, as the jsonl renders; checked here, or the model's forward
        # fails naming no file
        top = max(max(row, default=0) for row in rows)
        if top >= tokenizer.GPT2_VOCAB_SIZE:
            raise BadExamples(f"{path}: example {number}: token id {top} outside "
                              "GPT-2's vocabulary [0, "
                              f"{tokenizer.GPT2_VOCAB_SIZE}): damaged, or not GPT-2's tokens")
        examples.append(Example(rows, lens, label))
        pos += size // 2
    if not examples:
        raise BadExamples(f"{path}: no HellaSwag examples")
    return examples


def render(example, encoding) -> Example:
    """llm.c's render_example: ctx tokens + tokens of " " + ending, for each of the 4 endings."""
    ctx = encoding.encode_ordinary(example["ctx"])
    rows, lens = [], []
    for ending in example["endings"]:
        end = encoding.encode_ordinary(" " + ending)
        rows.append(ctx + end)
        lens.append(len(end))
    return Example(rows, lens, example["label"])


def longest_row(examples) -> int:
    return max(len(r) for ex in examples for r in ex.rows)


def long_endings(examples, T) -> int:
    """How many endings have more than T tokens: score() keeps only their last T."""
    return sum(n > T for ex in examples for n in ex.ending_lens)


def score(model, examples, on_batch=None) -> Result:
    """Summed and mean loss of each ending of each rendered example, in batches of model.B rows
    padded to the longest row of the batch (at most model.T + 1 tokens: longer rows keep their end,
    and an ending of more than T tokens only its last T). An ending's first token counts only after
    some context (with an empty ctx nothing predicts it, as in llm.c's hellaswag.py)."""
    rows = [(i, j, ex.rows[j][-(model.T + 1):], min(ex.ending_lens[j], model.T))
            for i, ex in enumerate(examples) for j in range(4)]
    sums = np.zeros((len(examples), 4))
    counts = np.zeros((len(examples), 4))
    for lo in range(0, len(rows), model.B):
        batch = rows[lo:lo + model.B]
        # at least one position (one-token rows)
        t = max(max(len(r) for _, _, r, _ in batch) - 1, 1)
        x = np.zeros((len(batch), t), dtype=np.int32)
        y = np.zeros((len(batch), t), dtype=np.int32)
        mask = np.zeros((len(batch), t), dtype=bool)
        for k, (_, _, r, n_end) in enumerate(batch):
            n = len(r) - 1
            x[k, :n], y[k, :n] = r[:-1], r[1:]
            mask[k, max(n - n_end, 0):n] = True      # the targets that are the ending's tokens
        model.forward(x, y)
        losses = model.backend.to_host(model.act["losses"]).reshape(len(batch),
                                                                    t).astype(np.float64)
        for k, (i, j, _, _) in enumerate(batch):
            sums[i, j] = losses[k][mask[k]].sum()
            counts[i, j] = mask[k].sum()
        if on_batch:
            on_batch(sum(j == 3 for _, j, _, _ in batch))     # examples finished
    labels = np.array([ex.label for ex in examples])
    return Result(sums, sums / np.maximum(counts, 1), labels)


def evaluate(model, examples, desc="hellaswag", show_progress=True) -> Result:
    """score() with a progress bar over the examples, after a note when some endings are longer
    than the model's T tokens (only their last T are scored)."""
    cut = long_endings(examples, model.T)
    if cut:
        print(f"note: {cut} of {4 * len(examples)} endings have more than T = {model.T} tokens: "
              f"only their last {model.T} tokens are scored", file=sys.stderr, flush=True)
    with progress(total=len(examples), desc=desc, unit="example", quiet=not show_progress) as bar:
        return score(model, examples, on_batch=bar.update)


def load(path=None, encoding=None, max_examples=-1, cache=None, timeout=10, local_flag=None):
    """Rendered examples of `path` (default: hellaswag_val.jsonl, downloaded into the cache if
    missing). local_flag: the flag that gives a local file instead (eval's -j), named when the
    download fails."""
    if not path:
        try:
            path = cached(VAL_FILE, cache, timeout=timeout)
        except fetch.FetchError as e:
            if local_flag is None:
                raise
            raise fetch.FetchError(f"{e}; a local copy can be given with {local_flag} FILE "
                                   f"(hellaswag_val.jsonl, or llm.c's hellaswag_val.bin)") from None
    path = Path(path)
    # llm.c's hellaswag_val.bin: tokens already
    if path.is_file() and is_llmc_evalfile(path):
        return path, read_llmc_evalfile(path, max_examples)
    encoding = encoding or tokenizer.get_encoding()
    return path, [render(e, encoding) for e in read_examples(path, max_examples)]
