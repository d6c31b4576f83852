"""llm.c model files (fp32 v3, bf16 v5), training state files, atomic writes, and every bad-file case."""
import os

import numpy as np
import pytest
import torch

from gpt2np.checkpoint import (
    CheckpointError,
    atomic_write,
    bf16_to_fp32,
    fp32_to_bf16,
    load_model,
    load_state,
    read_model_header,
    save_model,
    save_state,
)
from gpt2np.config import GPT2Config, preset
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
    ("magic", "bad magic 20240327"), ("version", "unsupported version 4"), ("truncated", "truncated"),
    ("too_long", "more than the header"), ("short_header", "shorter than the 1024-byte header"),
    ("impossible", "impossible model"), ("no_heads", "num_heads must be positive"),
    ("missing", "no such model file")])
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
    assert got == info
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    with pytest.raises(CheckpointError, match="the model has 999"):
        load_state(path, 999)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_state(path, n)
    path.write_bytes(b"NOTSTATE" + b"\0" * 40)
    with pytest.raises(CheckpointError, match="not a gpt2np state file"):
        load_state(path, n)
