"""llm.c token shards (.bin files of uint16 GPT-2 token ids) and the DataLoader that
cuts them into batches.

Shard layout (llm.c, dev/data/data_common.py): a header of 256 int32 -- [0] = 20240520 (magic),
[1] = 1 (version), [2] = number of tokens -- followed by the tokens as little-endian uint16.

The DataLoader follows llm.c's dataloader.h: a "sample" is a window of num_processes*B*T+1 tokens
starting at a multiple of num_processes*B*T inside one shard; rank r takes the B*T+1 tokens starting
at r*B*T inside it, so the ranks of one step read disjoint slices. A shard holds
(num_tokens - 1) // (num_processes*B*T) samples; the tail that does not fit is skipped.

The loader reads each batch's B*T+1 tokens with a plain read, after checking the shard's size and
header against what it saw when it started: a shard truncated or rewritten under a running job is a
DataError naming the file and what changed (a memory map would die of SIGBUS
reading past the new end).
"""
import glob
import hashlib
import os
from pathlib import Path

import numpy as np

from gpt2np.fileio import atomic_write
from gpt2np.rng import llmc_generator  # noqa: F401  (the loader's shuffle)

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
# a shard's signature hashes its header and this many bytes at each end
SIGNATURE_BYTES = 1 << 16


class DataError(ValueError):
    """A token shard, a file pattern or a loader state is unusable; the message names the file."""


def write_shard(path, tokens):
    """Write `tokens` (1-D integer array-like, values in [0, 65536)) as an llm.c
    shard, atomically."""
    toks = np.asarray(tokens)
    if toks.ndim != 1:
        raise DataError(f"{path}: tokens must be a 1-D array, got shape {toks.shape}")
    if toks.size and not np.issubdtype(toks.dtype, np.integer):
        raise DataError(f"{path}: tokens must be integers, got dtype {toks.dtype}")
    if toks.size and (toks.min() < 0 or toks.max() >= 2**16):
        raise DataError(f"{path}: token ids must lie in [0, 65536) to fit uint16, "
                        f"got range [{toks.min()}, {toks.max()}]")
    if toks.size >= 2**31:
        raise DataError(f"{path}: {toks.size} tokens do not fit the int32 count in the header")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, toks.size
    with atomic_write(path) as f:
        f.write(header.tobytes())
        f.write(toks.astype(TOKEN_DTYPE).tobytes())


def read_shard_header(path) -> int:
    """Check a shard's header against its file size; returns the number of tokens it holds."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"{path}: token shard not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read token shard ({e.strerror or e})") from None
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: truncated token shard: {size} bytes, "
                        f"shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: not an llm.c token shard (magic {header[0]}, "
                        f"expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported token shard version {header[1]} (expected "
                        f"{SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        what = ("truncated token shard" if size < expected
                else "token shard size disagrees with header")
        raise DataError(f"{path}: {what}: header says {num_tokens} tokens ({expected} bytes), "
                        f"file has {size} bytes")
    return num_tokens


def _shard_change(path, num_tokens, expected_size, size, header) -> str:
    """The one line saying how a shard differs from when the loader opened it."""
    was = f"it had {num_tokens} tokens ({expected_size} bytes) when the run started"
    if size < expected_size:
        return f"{path}: token shard shrank while training: now {size} bytes, {was}"
    if size > expected_size:
        return f"{path}: token shard grew while training: now {size} bytes, {was}"
    return (f"{path}: token shard header changed while training: now magic {header[0]}, version "
            # the same size: the header has all its 12 bytes
            f"{header[1]}, {header[2]} tokens; {was}")


def shard_hash(path, num_tokens) -> str:
    """A short hash of a shard's header and its first and last SIGNATURE_BYTES of tokens
    (cheap for any size)."""
    end = HEADER_BYTES + TOKEN_DTYPE.itemsize * num_tokens
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            digest.update(f.read(HEADER_BYTES + SIGNATURE_BYTES))
            f.seek(max(HEADER_BYTES, end - SIGNATURE_BYTES))
            digest.update(f.read(SIGNATURE_BYTES))
    except OSError as e:
        raise DataError(f"{path}: cannot read token shard ({e.strerror or e})") from None
    return digest.hexdigest()[:12]


def read_shard(path, mmap=True) -> np.ndarray:
    """The tokens of a shard as a 1-D np.uint16 array (a read-only np.memmap when mmap=True)."""
    num_tokens = read_shard_header(path)
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint16)
    if mmap:
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES,
                         shape=(num_tokens,))
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        return np.fromfile(f, dtype=TOKEN_DTYPE, count=num_tokens)


def expand_patterns(pattern_or_patterns):
    """Sorted, de-duplicated list of files matching one glob pattern or a list of them.

    Every pattern must match at least one file.
    """
    patterns = ([pattern_or_patterns] if isinstance(pattern_or_patterns, (str, os.PathLike))
                else list(pattern_or_patterns))
    if not patterns:
        raise DataError("no token shard pattern given")
    files = set()
    for pattern in patterns:
        matches = [m for m in glob.glob(os.fspath(pattern)) if os.path.isfile(m)]
        if not matches:
            raise DataError(f"{pattern}: no token shard matches this pattern")
        files.update(matches)
    return sorted(files)


SHUFFLE_SEED = 42                  # llm.c's: each rank's shuffle generator is seeded 42 + its rank


def llmc_permute(order: list, generator: np.random.MT19937) -> list:
    """llm.c's random_permutation in place: for i = n-1 down to 1, swap order[i] with
    order[randint32 % (i+1)]."""
    n = len(order)
    if n > 1:
        picks = (generator.random_raw(n - 1) % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
        for i, j in zip(range(n - 1, 0, -1), picks):
            order[i], order[j] = order[j], order[i]
    return order


class DataLoader:
    """Batches of (inputs, targets), each (B, T) int32 with targets = inputs shifted by one token.

    pattern_or_patterns: glob pattern(s) of shard files, read in sorted order.
    process_rank / num_processes: this rank's slice of every global batch (see module docstring).
    shuffle: llm.c's order (dataloader.h): one mt19937 stream per rank, seeded SHUFFLE_SEED + rank,
        permutes the shard order at the start of every epoch (the previous epoch's order, permuted
        again) and the samples of each shard as the loader reaches it. Each rank reads its slice of
        every sample once an epoch, in its own order, as llm.c's ranks do.
    vocab_size: if given, token ids >= vocab_size raise DataError naming the file and position.

    The read position is (epoch, shard_position, sample_position); llmc_state()/load_llmc_state()
    save and restore it as llm.c's state file keeps it (with the shuffle generator's state), so a
    resumed run continues with exactly the batches it would have seen; state() holds the settings
    check_settings compares.
    """

    def __init__(self, pattern_or_patterns, B, T, process_rank=0, num_processes=1,
                 shuffle=False, vocab_size=None):
        if B <= 0 or T <= 0:
            raise DataError(f"DataLoader: B and T must be positive, got B={B}, T={T}")
        if num_processes <= 0 or not 0 <= process_rank < num_processes:
            raise DataError(f"DataLoader: need 0 <= process_rank < num_processes, "
                            f"got process_rank={process_rank}, num_processes={num_processes}")
        self.B, self.T = int(B), int(T)
        self.process_rank, self.num_processes = int(process_rank), int(num_processes)
        self.shuffle = bool(shuffle)
        self.vocab_size = vocab_size
        self.files = expand_patterns(pattern_or_patterns)
        self.sample_tokens = self.num_processes * self.B * self.T   # stride between samples
        self.shard_num_tokens = [read_shard_header(f) for f in self.files]
        self.shard_num_samples = []
        for path, n in zip(self.files, self.shard_num_tokens):
            samples = max(n - 1, 0) // self.sample_tokens
            if samples == 0:
                raise DataError(f"{path}: token shard too small: {n} tokens, need at least "
                                f"num_processes*B*T+1 = {self.sample_tokens + 1}")
            self.shard_num_samples.append(samples)
        # the first 12 header bytes (magic, version, tokens) as every batch's read must find them
        self._headers = [np.array([SHARD_MAGIC, SHARD_VERSION, n], "<i4").tobytes()
                         for n in self.shard_num_tokens]
        self.reset()

    @property
    def num_batches(self) -> int:
        """Batches per epoch (the same for every rank)."""
        return sum(self.shard_num_samples)

    def __len__(self):
        return self.num_batches

    def eval_batches(self, max_batches: int) -> int:
        """llm.c's val_num_batches: max_batches, or for -1 the tokens // (num_processes*B*T), which
        can be one more than the samples the shards hold (each shard's last token only ends a
        sample); reading past them wraps around to the first batch, as llm.c's loader does."""
        return max_batches if max_batches > 0 else self.num_tokens // self.sample_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens in all shards together."""
        return sum(self.shard_num_tokens)

    def reset(self):
        """Go back to the first batch of epoch 0 (with shuffle: the stream starts
        over from its seed)."""
        self.epoch, self.shard_position, self.sample_position = 0, 0, 0
        self._shard_order = list(range(len(self.files)))
        if self.shuffle:
            self._generator = llmc_generator(SHUFFLE_SEED + self.process_rank)
            llmc_permute(self._shard_order, self._generator)
        self._start_shard()

    def _start_shard(self):
        """The sample order of the shard at shard_position (with shuffle: the stream's
        next permutation)."""
        n = self.shard_num_samples[self._shard_order[self.shard_position]]
        self._sample_order = (llmc_permute(list(range(n)), self._generator) if self.shuffle
                              else range(n))

    def _next_shard(self):
        """Move to the next shard; past the last one, a new epoch (with shuffle: the shard
        order permuted again)."""
        self.shard_position += 1
        self.sample_position = 0
        if self.shard_position >= len(self.files):
            self.shard_position = 0
            self.epoch += 1
            if self.shuffle:
                llmc_permute(self._shard_order, self._generator)
        self._start_shard()

    def _read_tokens(self, shard_index, start, count):
        """Tokens [start, start+count) of a shard, read from the file after checking
        it has not changed."""
        path, num_tokens = self.files[shard_index], self.shard_num_tokens[shard_index]
        expected_size = HEADER_BYTES + TOKEN_DTYPE.itemsize * num_tokens
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                header = os.pread(fd, 12, 0)
                raw = os.pread(fd, TOKEN_DTYPE.itemsize * count,
                               HEADER_BYTES + TOKEN_DTYPE.itemsize * start)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise DataError(f"{path}: token shard disappeared while training") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read token shard ({e.strerror or e})") from None
        if size != expected_size or header != self._headers[shard_index]:
            raise DataError(_shard_change(path, num_tokens, expected_size, size,
                                          np.frombuffer(header, "<i4")))
        # truncated between the size check and the read
        if len(raw) != TOKEN_DTYPE.itemsize * count:
            raise DataError(f"{path}: token shard shrank while training: reading tokens "
                            f"{start}..{start + count} got {len(raw) // TOKEN_DTYPE.itemsize} of "
                            f"them; it had {num_tokens} tokens when the run started")
        return np.frombuffer(raw, dtype=TOKEN_DTYPE)

    def next_batch(self):
        """Returns (inputs, targets), both (B, T) int32, and advances the position."""
        if self.sample_position >= len(self._sample_order):
            self._next_shard()
        shard_index = self._shard_order[self.shard_position]
        sample = self._sample_order[self.sample_position]
        start = sample * self.sample_tokens + self.process_rank * self.B * self.T
        window = self._read_tokens(shard_index, start, self.B * self.T + 1)
        if self.vocab_size is not None:
            bad = np.flatnonzero(window >= self.vocab_size)
            if bad.size:
                raise DataError(f"{self.files[shard_index]}: token id {window[bad[0]]} at token "
                                f"position {start + bad[0]} is >= vocab_size {self.vocab_size}")
        self.sample_position += 1
        window = window.astype(np.int32)
        inputs = window[:-1].reshape(self.B, self.T)
        targets = window[1:].reshape(self.B, self.T)
        return inputs, targets

    def signature(self) -> list:
        """[(file name, tokens, content hash)] per shard, in file order: what ranks compare to be
        sure they read the same data (the hash covers the header and the first and last
        SIGNATURE_BYTES of tokens)."""
        return [(os.path.basename(path), n, shard_hash(path, n))
                for path, n in zip(self.files, self.shard_num_tokens)]

    def state(self) -> dict:
        """The read position and the settings it depends on, as a dict of plain ints."""
        state = {"epoch": self.epoch, "shard_position": self.shard_position,
                 "sample_position": self.sample_position, "B": self.B, "T": self.T,
                 "num_processes": self.num_processes, "num_shards": len(self.files),
                 "num_tokens": self.num_tokens, "shuffle": int(self.shuffle)}
        if self.shuffle:
            state["shuffle_seed"] = SHUFFLE_SEED + self.process_rank      # llm.c's order
        return state

    def llmc_state(self) -> dict:
        """The position as llm.c's state file keeps it (train_gpt2.cu save_state): shard_idx,
        sample_idx and, with shuffle, the shard order, the current shard's sample order and the
        shuffle generator's MT19937 state (mt_key: its 624 words, mt_pos: how many
        of them were used)."""
        state = {"shuffle": self.shuffle, "shard_idx": self.shard_position,
                 "sample_idx": self.sample_position}
        if self.shuffle:
            mt = self._generator.state["state"]
            state.update(shard_indices=list(self._shard_order),
                         sample_indices=list(self._sample_order),
                         mt_key=np.asarray(mt["key"], np.uint32), mt_pos=int(mt["pos"]))
        return state

    def load_llmc_state(self, state: dict, epoch=0, source=""):
        """Continue from llm.c's position (llmc_state()'s keys, as a state file holds them); `epoch`
        only says which epoch it is (llm.c does not count them). Raises DataError when it does
        not fit this data."""
        where = f"{source}: " if source else ""
        if bool(state["shuffle"]) != self.shuffle:
            raise DataError(f"{where}the train data was read with "
                            f"shuffle={int(bool(state['shuffle']))}, this run "
                            f"has --shuffle {int(self.shuffle)}")
        shard_pos, sample_pos = int(state["shard_idx"]), int(state["sample_idx"])
        if not 0 <= shard_pos < len(self.files):
            raise DataError(f"{where}shard position {shard_pos}, the train data has "
                            f"{len(self.files)} shard(s)")
        if self.shuffle:
            order, samples = ([int(i) for i in state["shard_indices"]],
                              [int(i) for i in state["sample_indices"]])
            if sorted(order) != list(range(len(self.files))):
                raise DataError(f"{where}its shard order is not a permutation of the "
                                f"{len(self.files)} shard(s) here")
            n = self.shard_num_samples[order[shard_pos]]
            if sorted(samples) != list(range(n)):
                raise DataError(f"{where}its sample order is not a permutation of the {n} samples "
                                f"of {self.files[order[shard_pos]]}")
            self._generator = np.random.MT19937()
            self._generator.state = {"bit_generator": "MT19937",
                                     "state": {"key": np.asarray(state["mt_key"], np.uint32),
                                               "pos": int(state["mt_pos"])}}
            self._shard_order, self._sample_order = order, samples
        else:
            self._shard_order = list(range(len(self.files)))
            self._sample_order = range(self.shard_num_samples[shard_pos])
        if not 0 <= sample_pos <= len(self._sample_order):
            raise DataError(f"{where}sample position {sample_pos}, the shard has "
                            f"{len(self._sample_order)} samples")
        self.epoch, self.shard_position, self.sample_position = int(epoch), shard_pos, sample_pos

    def check_settings(self, state: dict, source="DataLoader.check_settings"):
        """state() of a loader with the same settings and data as this one, or a DataError naming
        the first difference."""
        mine = self.state()
        for key in ("B", "T", "num_processes", "num_shards", "num_tokens", "shuffle"):
            if key not in state:
                raise DataError(f"{source}: saved state lacks '{key}'")
            if int(state[key]) != mine[key]:
                raise DataError(f"{source}: state was saved with {key}={state[key]}, "
                                f"this loader ({self.files[0]}, ...) has {key}={mine[key]}")
