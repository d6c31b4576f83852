"""llm.c model files (fp32 v3, bf16 v5), training state files, atomic writes, and
every bad-file case."""
import os

import numpy as np
import pytest
import torch

from gpt2np.config import GPT2Config, preset
from gpt2np.fileio import atomic_write
from gpt2np.formats.checkpoint import (
    CheckpointError,
    bf16_to_fp32,
    fp32_to_bf16,
    load_model,
    load_state,
    read_model_header,
    save_model,
    save_state,
)
from gpt2np.tensors import num_parameters

CFG = GPT2Config(16, 37, 64, 2, 2, 8)


def params(cfg=CFG, seed=0):
    return np.random.default_rng(seed).standard_normal(num_parameters(cfg)).astype(np.float32)


def test_fp32_round_trip_and_header(tmp_path):
    p = params()
    path = tmp_path / "m.bin"
    save_model(path, CFG, p)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:8]) == [20240326, 3, 16, 37, 2, 2, 8, 64]
    assert os.path.getsize(path) == 1024 + 4 * p.size
    cfg, loaded = load_model(path)
    assert cfg == CFG
    np.testing.assert_array_equal(loaded, p)


def test_bf16_round_trip_matches_torch_rounding(tmp_path):
    p = params()
    p[:4] = [1.0, -2.5, 3.0e38, 1e-40]
    path = tmp_path / "m16.bin"
    save_model(path, CFG, p, dtype="bf16")
    assert np.fromfile(path, dtype="<i4", count=2)[1] == 5
    assert os.path.getsize(path) == 1024 + 2 * p.size
    cfg, loaded = load_model(path)
    expected = torch.from_numpy(p).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(loaded, expected)
    bits = fp32_to_bf16(np.array([np.nan, np.inf, -np.inf], np.float32))
    out = bf16_to_fp32(bits)
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf


def test_d12_param_count():
    assert num_parameters(preset("d12")) == 124475904          # llm.c's GPT-2 124M with Vp = 50304


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[:4] = (20240327).to_bytes(4, "little")
    elif how == "version":
        data[4:8] = (4).to_bytes(4, "little")
    elif how == "truncated":
        data = data[:-10]
    elif how == "too_long":
        data += b"\0" * 8
    elif how == "short_header":
        data = data[:100]
    elif how == "impossible":
        data[24:28] = (7).to_bytes(4, "little")            # C=7 is not a multiple of NH=2
    elif how == "no_heads":
        data[20:24] = (0).to_bytes(4, "little")            # NH=0 (checked before C % NH is taken)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, message", [
    ("magic", "bad magic 20240327"), ("version", "unsupported version 4"),
    ("truncated", "truncated"), ("too_long", "more than the header"),
    ("short_header", "shorter than the 1024-byte header"), ("impossible", "impossible model"),
    ("no_heads", "num_heads must be positive"), ("missing", "no such model file")])
def test_bad_model_file_is_one_clear_line(tmp_path, how, message):
    path = tmp_path / "m.bin"
    save_model(path, CFG, params())
    if how == "missing":
        path = tmp_path / "absent.bin"
    else:
        corrupt(path, how)
    with pytest.raises(CheckpointError) as e:
        read_model_header(path)
    text = str(e.value)
    assert "\n" not in text and str(path) in text and message in text


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "m.bin"
    save_model(path, CFG, params(seed=1))
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write(b"partial")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.bin"]                 # no temp file left behind


def test_state_round_trip_and_bad_state(tmp_path):
    n = 1000
    m, v = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    info = {"step": 7, "train_loader": {"epoch": 0, "shard": 1}, "rng": {"state": 123}}
    path = tmp_path / "state.bin"
    save_state(path, info, m, v)
    got, m2, v2 = load_state(path, n)
    assert {k: got[k] for k in info} == info and got["n"] == n and got["master_weights"] is False
    assert got["loader"] == {"shuffle": False, "shard_idx": 0, "sample_idx": 0}
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    with pytest.raises(CheckpointError, match="the model has 999"):
        load_state(path, 999)
    whole = path.read_bytes()
    for cut in (4, 16, len(whole) - 2000):
        path.write_bytes(whole[:-cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_state(path, n)
    path.write_bytes(b"NOTSTATE" + b"\0" * 1040)
    with pytest.raises(CheckpointError, match="not a state file"):
        load_state(path, n)


# ---- llm.c's state layout, read and written as train_gpt2.cu's save_state / load_state do
# -----------------------
def llmc_randint32(state, left, next_, count):
    """llm.c's randint32 (llmc/rand.h) `count` times from a saved mt19937_state's
    state_, left_, next_."""
    state, out = list(state), []
    for _ in range(count):
        left -= 1
        if left <= 0:                                           # next_state: the reference twist
            for k in range(624):
                y = (state[k] & 0x80000000) | (state[(k + 1) % 624] & 0x7FFFFFFF)
                state[k] = state[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            left, next_ = 624, 0
        y = state[next_]
        next_ += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        out.append(y ^ (y >> 18))
    return out


def read_llmc_state(path, n, master):
    """What llm.c's load_state reads, parsed with struct from its layout (not gpt2np's reader)."""
    import struct
    raw = path.read_bytes()
    header = struct.unpack_from("<256i", raw)
    fields = {"rng": struct.unpack_from("<2Q", raw, 4 * 20),
              "magic": header[0], "version": header[1], "processes": header[2], "rank": header[3],
              "master": header[4], "shuffle": header[5], "step": header[10],
              "shard_idx": struct.unpack_from("<Q", raw, 4 * 30)[0],
              "sample_idx": struct.unpack_from("<Q", raw, 4 * 32)[0]}
    at = 1024
    arrays = []
    for _ in range(3 if master else 2):
        arrays.append(np.frombuffer(raw, "<f4", n, at))
        at += 4 * n
    if fields["shuffle"]:
        shards = struct.unpack_from("<Q", raw, at)[0]
        fields["shard_indices"] = list(struct.unpack_from(f"<{shards}i", raw, at + 8))
        at += 8 + 4 * shards
        samples = struct.unpack_from("<Q", raw, at)[0]
        fields["sample_indices"] = list(struct.unpack_from(f"<{samples}i", raw, at + 8))
        at += 8 + 4 * samples
        mt = struct.unpack_from("<QiI624I2I", raw, at)
        fields["mt"] = {"left": mt[1], "next": mt[2], "state": mt[3:627], "matrix_a": mt[627:]}
    return fields, arrays


def test_state_file_is_llmc_layout(tmp_path):
    from gpt2np.datasets.data import DataLoader, write_shard
    for i, size in enumerate((300, 170, 420)):
        write_shard(tmp_path / f"s_{i}.bin", np.arange(size) + 1000 * i)
    loader = DataLoader(str(tmp_path / "s_*.bin"), 2, 4, 1, 2, shuffle=True)      # rank 1 of 2
    # past its first shard (at most 26 samples)
    for _ in range(30):
        loader.next_batch()
    n = 500
    m, v, master = (np.random.default_rng(k).standard_normal(n).astype(np.float32)
                    for k in range(3))
    path = tmp_path / "state_00000009_00001.bin"
    save_state(path, {"step": 9, "world_size": 2, "rank": 1, "train_loader": loader.state(),
                      "rng": {}}, m, v, master, loader=loader.llmc_state())
    fields, arrays = read_llmc_state(path, n, master=True)
    assert (fields["magic"], fields["version"], fields["processes"], fields["rank"],
            fields["master"], fields["shuffle"], fields["step"]) == (20240527, 1, 2, 1, 1, 1, 9)
    assert (fields["shard_idx"], fields["sample_idx"]) == (loader.shard_position,
                                                           loader.sample_position)
    assert loader.shard_position >= 1
    for got, want in zip(arrays, (m, v, master)):
        np.testing.assert_array_equal(got, want)
    assert (fields["shard_indices"] == loader._shard_order
            and fields["sample_indices"] == list(loader._sample_order))
    assert fields["mt"]["matrix_a"] == (0, 0x9908B0DF)
    # llm.c's xorshift must not start at 0
    assert fields["rng"] == (13371337 + 1, 13371337 + 1)
    # llm.c continuing from the saved generator draws what the loader draws next
    after = llmc_randint32(fields["mt"]["state"], fields["mt"]["left"], fields["mt"]["next"], 700)
    assert after == loader._generator.random_raw(700).tolist()


def test_llmc_state_without_footer_loads(tmp_path):
    """An llm.c state file (no gpt2np footer, header ints past llm.c's 0): its header
    and loader fields."""
    n = 64
    m, v = np.full(n, 2.0, np.float32), np.full(n, 3.0, np.float32)
    path = tmp_path / "state.bin"
    save_state(path, {"step": 5, "world_size": 1, "rank": 0, "train_loader": {}, "rng": {}}, m, v)
    raw = bytearray(path.read_bytes())
    footer_len = int(np.frombuffer(bytes(raw[-16:-8]), "<u8")[0])
    llmc = raw[:len(raw) - 16 - footer_len]
    llmc[4 * 40:4 * 46] = bytes(24)                             # llm.c writes zeros there
    path.write_bytes(bytes(llmc))
    info, m2, v2 = load_state(path, n)
    assert info == {"step": 5, "world_size": 1, "rank": 0, "master_weights": False,
                    "loader": {"shuffle": False, "shard_idx": 0, "sample_idx": 0}}
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    path.write_bytes(bytes(llmc[:-4]))
    with pytest.raises(CheckpointError, match="not a whole number of parameters"):
        load_state(path)


def test_an_llmc_state_cut_before_its_loader_orders_is_one_line(tmp_path):
    """llm.c writes its state file in place: one killed after m and v has no loader section. That is
    a CheckpointError naming the file (not a struct error), however much of the section is there."""
    from gpt2np.datasets.data import DataLoader, write_shard
    write_shard(tmp_path / "s.bin", np.arange(400))
    loader = DataLoader(str(tmp_path / "s.bin"), 2, 4, shuffle=True)
    n = 32
    path = tmp_path / "state.bin"
    save_state(path, {"step": 2, "train_loader": loader.state()}, np.ones(n), np.ones(n),
               loader=loader.llmc_state())
    raw = bytearray(path.read_bytes())
    llmc = raw[:len(raw) - 16 - int(np.frombuffer(bytes(raw[-16:-8]), "<u8")[0])]
    llmc[4 * 40:4 * 46] = bytes(24)
    for keep in (1024 + 8 * n, 1024 + 8 * n + 4, 1024 + 8 * n + 12, len(llmc) - 1):
        path.write_bytes(bytes(llmc[:keep]))
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_state(path, n)
