"""Token shards (llm.c format) and the DataLoader: round trips, every bad input, batching semantics,
shards that change under a running loader."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2np.datasets.data import (
    HEADER_BYTES,
    SHARD_MAGIC,
    DataError,
    DataLoader,
    read_shard,
    read_shard_header,
    write_shard,
)
from gpt2np.fileio import atomic_write

REPO = Path(__file__).resolve().parent.parent


def one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert str(needle) in msg, msg


def make_shards(tmp_path, sizes, name="shard"):
    """Shard i holds i*10000, i*10000+1, ...: every token says where it came from."""
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"{name}_{i:03d}.bin"
        write_shard(p, i * 10000 + np.arange(n))
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------
# shard files

@pytest.mark.parametrize("mmap", [True, False])
def test_shard_round_trip(tmp_path, mmap):
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    path = tmp_path / "a.bin"
    write_shard(path, tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [SHARD_MAGIC, 1, 5]
    assert path.stat().st_size == HEADER_BYTES + 2 * 5
    got = read_shard(path, mmap=mmap)
    assert got.dtype == np.uint16 and got.tolist() == tokens.tolist()
    assert read_shard_header(path) == 5


def test_shard_round_trip_list_and_empty(tmp_path):
    write_shard(tmp_path / "l.bin", [3, 2, 1])
    assert read_shard(tmp_path / "l.bin").tolist() == [3, 2, 1]
    write_shard(tmp_path / "e.bin", [])
    assert read_shard(tmp_path / "e.bin").shape == (0,)


@pytest.mark.parametrize("tokens, needle", [
    (np.array([1, 65536]), "65536"),
    (np.array([-1, 3]), "-1"),
    (np.zeros((2, 2), dtype=np.int32), "1-D"),
    (np.array([1.5, 2.0]), "integers"),
])
def test_write_shard_rejects_bad_tokens(tmp_path, tokens, needle):
    path = tmp_path / "bad.bin"
    with pytest.raises(DataError) as e:
        write_shard(path, tokens)
    one_line_error(e, path, needle)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, [1, 2, 3])
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert read_shard(path).tolist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def corrupt(path, mutate):
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(mutate(raw)))


def set_int(raw, index, value):
    raw[4 * index:4 * index + 4] = np.int32(value).tobytes()
    return raw


@pytest.mark.parametrize("mutate, needle", [
    (lambda raw: set_int(raw, 0, 12345), "magic 12345"),
    (lambda raw: set_int(raw, 1, 7), "version 7"),
    (lambda raw: raw[:100], "truncated"),
    (lambda raw: raw[:-2], "truncated"),
    (lambda raw: raw + b"\0\0", "disagrees"),
    (lambda raw: set_int(raw, 2, 4), "disagrees"),
])
def test_read_shard_rejects_bad_files(tmp_path, mutate, needle):
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(10))
    corrupt(path, mutate)
    with pytest.raises(DataError) as e:
        read_shard(path)
    one_line_error(e, path, needle)


def test_read_shard_missing_file(tmp_path):
    with pytest.raises(DataError) as e:
        read_shard(tmp_path / "nope.bin")
    one_line_error(e, "nope.bin", "not found")


# ---------------------------------------------------------------------------------------------
# DataLoader

def test_loader_pattern_errors(tmp_path):
    make_shards(tmp_path, [100])
    with pytest.raises(DataError) as e:
        DataLoader(str(tmp_path / "missing_*.bin"), 2, 4)
    one_line_error(e, "missing_*.bin", "no token shard")
    with pytest.raises(DataError) as e:   # every pattern of a list must match
        DataLoader([str(tmp_path / "shard_*.bin"), str(tmp_path / "other_*.bin")], 2, 4)
    one_line_error(e, "other_*.bin")


def test_loader_shard_too_small(tmp_path):
    make_shards(tmp_path, [2 * 4 * 2])   # needs num_processes*B*T + 1 = 17 tokens
    with pytest.raises(DataError) as e:
        DataLoader(str(tmp_path / "*.bin"), 4, 2, process_rank=1, num_processes=2)
    one_line_error(e, "shard_000.bin", "17")


def test_loader_bad_arguments(tmp_path):
    make_shards(tmp_path, [100])
    for kwargs in ({"B": 0, "T": 4}, {"B": 2, "T": 4, "process_rank": 2, "num_processes": 2}):
        with pytest.raises(DataError):
            DataLoader(str(tmp_path / "*.bin"), **kwargs)


def test_loader_sequential_windows(tmp_path):
    B, T = 2, 3
    make_shards(tmp_path, [20, 14])   # samples: (20-1)//6 = 3 and (14-1)//6 = 2
    loader = DataLoader(str(tmp_path / "shard_*.bin"), B, T)
    assert loader.num_batches == len(loader) == 5 and loader.num_tokens == 34
    starts = [0, 6, 12, 10000, 10006]
    for epoch in range(2):
        for s in starts:
            x, y = loader.next_batch()
            assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == y.shape == (B, T)
            assert x.ravel().tolist() == list(range(s, s + B * T))
            assert y.ravel().tolist() == list(range(s + 1, s + B * T + 1))   # inputs shifted by one
            np.testing.assert_array_equal(x.ravel()[1:], y.ravel()[:-1])
        assert loader.epoch == epoch   # the wrap happens on the next call
    loader.next_batch()
    assert loader.epoch == 2
    loader.reset()
    assert loader.next_batch()[0].ravel()[0] == 0


def collect(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_two_ranks_cover_what_one_rank_with_2B_covers(tmp_path):
    B, T = 2, 4
    make_shards(tmp_path, [70, 50, 90])
    pattern = str(tmp_path / "*.bin")
    ranks = [DataLoader(pattern, B, T, r, 2) for r in range(2)]
    whole = DataLoader(pattern, 2 * B, T)
    # (n-1)//16
    assert ranks[0].num_batches == ranks[1].num_batches == whole.num_batches == 4 + 3 + 5
    for _ in range(2 * whole.num_batches + 3):   # over two epochs
        x0, y0 = ranks[0].next_batch()
        x1, y1 = ranks[1].next_batch()
        xw, yw = whole.next_batch()
        np.testing.assert_array_equal(np.concatenate([x0, x1]), xw)
        np.testing.assert_array_equal(np.concatenate([y0, y1]), yw)
        assert not set(x0.ravel()) & set(x1.ravel())   # disjoint


# ---- llm.c's shuffled order, computed independently: its mt19937 (llmc/rand.h) and
# dataloader.h, as C does it ----
class ReferenceMT19937:
    """The reference Mersenne Twister (Matsumoto & Nishimura), one 32-bit word at a time."""

    def __init__(self, seed):
        self.mt = [seed & 0xFFFFFFFF]
        for j in range(1, 624):
            self.mt.append((1812433253 * (self.mt[-1] ^ (self.mt[-1] >> 30)) + j) & 0xFFFFFFFF)
        self.index = 624

    def randint32(self):
        if self.index >= 624:
            for k in range(624):
                y = (self.mt[k] & 0x80000000) | (self.mt[(k + 1) % 624] & 0x7FFFFFFF)
                self.mt[k] = self.mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def test_reference_mt19937_is_llmc_rand_h():
    rng = ReferenceMT19937(137)                 # llmc/rand.h's example output for manual_seed(137)
    assert [rng.randint32() for _ in range(5)] == [4053805790, 2173880614, 380293709, 1237255315,
                                                   2986595568]


def llmc_reads(shard_samples, rank, count):
    """(shard, sample) of the first `count` batches rank `rank` reads: dataloader.h's reset /
    advance / next_batch."""
    rng = ReferenceMT19937(42 + rank)

    def permute(xs):
        for i in range(len(xs) - 1, 0, -1):
            j = rng.randint32() % (i + 1)
            xs[i], xs[j] = xs[j], xs[i]

    shard_indices = list(range(len(shard_samples)))
    state = {}

    def load(position):
        state.update(position=position, sample=0,
                     order=list(range(shard_samples[shard_indices[position]])))
        permute(state["order"])

    def reset():
        permute(shard_indices)
        load(0)

    reset()
    reads = []
    for _ in range(count):
        if state["sample"] >= len(state["order"]):
            if state["position"] == len(shard_samples) - 1:
                reset()
            else:
                load(state["position"] + 1)
        reads.append((shard_indices[state["position"]], state["order"][state["sample"]]))
        state["sample"] += 1
    return reads


@pytest.mark.parametrize("ranks", [1, 2])
def test_shuffle_is_llmc_order(tmp_path, ranks):
    B, T = 1, 4
    make_shards(tmp_path, [41, 33, 25, 57])   # (n-1) // (ranks*B*T) samples each
    pattern = str(tmp_path / "*.bin")
    stride = ranks * B * T
    samples = [(n - 1) // stride for n in (41, 33, 25, 57)]
    for rank in range(ranks):
        loader = DataLoader(pattern, B, T, rank, ranks, shuffle=True)
        count = 3 * loader.num_batches + 5                          # over three epochs
        reads = llmc_reads(samples, rank, count)
        expected = [10000 * shard + sample * stride + rank * B * T for shard, sample in reads]
        got = [int(loader.next_batch()[0][0, 0]) for _ in range(count)]
        assert got == expected
    in_order = [int(x[0, 0])
                for x, _ in collect(DataLoader(pattern, B, T, rank, ranks), loader.num_batches)]
    first_epoch = got[:loader.num_batches]
    # an epoch reads every sample once
    assert sorted(first_epoch) == sorted(in_order) and first_epoch != in_order
    x, y = DataLoader(pattern, 2, 4, shuffle=True).next_batch()
    np.testing.assert_array_equal(x.ravel() + 1, y.ravel())


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_resume_is_bit_identical(tmp_path, shuffle):
    make_shards(tmp_path, [60, 45, 80])
    pattern = str(tmp_path / "*.bin")
    ref = DataLoader(pattern, 2, 5, shuffle=shuffle)
    expected = collect(ref, 30)   # crosses shards and an epoch boundary
    for k in (0, 4, 5, 11, 17):
        run = DataLoader(pattern, 2, 5, shuffle=shuffle)
        collect(run, k)
        state = json.loads(json.dumps(run.state()))   # plain ints survive JSON
        assert all(type(v) is int for v in run.state().values())
        resumed = DataLoader(pattern, 2, 5, shuffle=shuffle)
        resumed.check_settings(state)
        resumed.load_llmc_state(run.llmc_state(), epoch=state["epoch"])
        for (x, y), (xe, ye) in zip(collect(resumed, 30 - k), expected[k:]):
            np.testing.assert_array_equal(x, xe)
            np.testing.assert_array_equal(y, ye)


def test_loader_state_rejects_other_settings(tmp_path):
    make_shards(tmp_path, [60])
    pattern = str(tmp_path / "*.bin")
    state = DataLoader(pattern, 2, 5).state()
    with pytest.raises(DataError) as e:
        DataLoader(pattern, 3, 5).check_settings(state)
    one_line_error(e, "B=2", "B=3")
    with pytest.raises(DataError):
        DataLoader(pattern, 2, 5, shuffle=True).check_settings(state)
    with pytest.raises(DataError):
        DataLoader(pattern, 2, 5).load_llmc_state(dict(DataLoader(pattern, 2, 5).llmc_state(),
                                                       sample_idx=99))


def test_token_beyond_vocab_is_an_error(tmp_path):
    tokens = np.arange(40)
    tokens[13] = 50300
    write_shard(tmp_path / "v.bin", tokens)
    loader = DataLoader(str(tmp_path / "v.bin"), 1, 8, vocab_size=50257)
    loader.next_batch()   # tokens 0..8 are fine
    with pytest.raises(DataError) as e:
        loader.next_batch()
    one_line_error(e, "v.bin", "50300", "position 13", "50257")
    DataLoader(str(tmp_path / "v.bin"), 1, 8).next_batch()   # no vocab_size: no check


# ---------------------------------------------------------------------------------------------
# shards that change under a running loader: one clear DataError, never SIGBUS

TRUNCATE_UNDER_LOADER = """
import os, sys
import numpy as np
from gpt2np.datasets.data import DataError, DataLoader, HEADER_BYTES, write_shard
path = sys.argv[1]
write_shard(path, np.arange(4000) % 50000)
loader = DataLoader(path, 4, 16, vocab_size=50257)
loader.next_batch()
os.truncate(path, HEADER_BYTES + 2 * 100)      # in place, as a crashed copy or `truncate -s` would
try:
    # on into pages past the new end, where a memory map faults
    for _ in range(loader.num_batches):
        loader.next_batch()
except DataError as e:
    print(e)
"""


def test_shard_truncated_under_a_loader_is_an_error_not_sigbus(tmp_path):
    # a separate process: with the shard memory-mapped (before), reading past the new end
    # killed it with SIGBUS
    path = tmp_path / "t.bin"
    proc = subprocess.run([sys.executable, "-c", TRUNCATE_UNDER_LOADER, str(path)],
                          capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                                  else proc.stderr)
    assert proc.stdout.strip() == (f"{path}: token shard shrank while training: now "
                                   f"{HEADER_BYTES + 200} bytes, it had 4000 tokens "
                                   f"({HEADER_BYTES + 8000} bytes) when the run started")


@pytest.mark.parametrize("change, needle", [
    (lambda p: os.truncate(p, HEADER_BYTES + 20), "shrank while training: now 1044 bytes"),
    (lambda p: p.open("ab").write(b"\0\0"), "grew while training: now 1226 bytes"),
    (lambda p: corrupt(p, lambda raw: set_int(raw, 2, 50)),
     "header changed while training: now magic 20240520, version 1, 50 tokens"),
    (lambda p: corrupt(p, lambda raw: set_int(raw, 0, 7)),
     "header changed while training: now magic 7"),
    (lambda p: p.unlink(), "disappeared while training"),
])
def test_shard_changed_under_a_loader(tmp_path, change, needle):
    path = tmp_path / "c.bin"
    write_shard(path, np.arange(100))
    loader = DataLoader(str(path), 2, 4)
    first = loader.next_batch()
    change(path)
    with pytest.raises(DataError) as e:
        loader.next_batch()
    one_line_error(e, path, needle)
    if "disappeared" not in needle:
        assert "100 tokens (1224 bytes) when the run started" in str(e.value)
    # put back as it was: the loader carries on
    write_shard(path, np.arange(100))
    loader.reset()
    np.testing.assert_array_equal(loader.next_batch()[0], first[0])


def test_signature_names_sizes_and_content(tmp_path):
    make_shards(tmp_path, [60, 45])
    pattern = str(tmp_path / "*.bin")
    sig = DataLoader(pattern, 2, 4).signature()
    assert [(name, n) for name, n, _ in sig] == [("shard_000.bin", 60), ("shard_001.bin", 45)]
    assert sig == DataLoader(pattern, 1, 8).signature()            # data only, not the batch shape
    # same name and size, other tokens
    write_shard(tmp_path / "shard_001.bin", np.arange(45) + 1)
    assert DataLoader(pattern, 2, 4).signature()[1][2] != sig[1][2]


def test_eval_batches_is_llmc_val_num_batches(tmp_path):
    """-m -1 counts as llm.c's val_num_batches: all the tokens // (processes*B*T), one more than the
    samples a shard of exactly 4*B*T tokens holds (its last token ends no sample); the loader then
    wraps to the first batch."""
    write_shard(tmp_path / "val.bin", np.arange(4 * 2 * 8))
    loader = DataLoader(str(tmp_path / "val.bin"), 2, 8)
    assert loader.num_batches == 3 and loader.eval_batches(-1) == 4 and loader.eval_batches(7) == 7
    firsts = [int(loader.next_batch()[0][0, 0]) for _ in range(loader.eval_batches(-1))]
    assert firsts == [0, 16, 32, 0]
