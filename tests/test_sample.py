"""Sampling with a cache of keys and values: every position's logits equal the full forward pass's
(<= 1e-5), generation with and without the cache gives the same tokens, the cache restarts from the
last half when full, and `gpt2np sample` tokenizes, generates and prints (bad flags:
one line, exit 2)."""
import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.cli import sample
from gpt2np.config import GPT2Config, pad_vocab
from gpt2np.formats.checkpoint import save_model
from gpt2np.generate import KVCache, generate, sample_next
from gpt2np.model import GPT2
from gpt2np.rng import LlmcCoins

TOL = 1e-5


def tiny_model(maxT=16, V=100, L=2, NH=2, C=16, seed=3, B=1, T=None):
    cfg = GPT2Config(maxT, V, pad_vocab(V), L, NH, C)
    model = GPT2(cfg, get_backend("numpy"), B, T or maxT, seed=seed)
    # weights larger than init's, so errors would show
    rng = np.random.default_rng(seed)
    model.load_params(model.params_host()
                      + rng.standard_normal(model.num_parameters).astype(np.float32) * 0.3)
    return model


def full_logits(model, tokens):
    model.forward(np.asarray(tokens)[None])
    return model.logits_host()[0, :, :model.cfg.vocab_size]


@pytest.mark.parametrize("prefill", [1, 5, 16])
def test_every_position_matches_the_full_forward(prefill):
    model = tiny_model()
    tokens = np.random.default_rng(0).integers(0, 100, 16)
    expected = full_logits(model, tokens)
    kv = KVCache(model)
    got = [kv.decode(tokens[:prefill], all_logits=True)]
    got += [kv.decode(tokens[t:t + 1], all_logits=True) for t in range(prefill, 16)]
    got = np.concatenate(got)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOL * max(1.0, np.abs(expected).max())
    assert kv.length == 16
    assert kv.k.shape == kv.v.shape == (2, 2, 16, 8)                # (L, NH, maxT, HS)
    with pytest.raises(ValueError, match="KV cache full"):
        kv.decode([1])


def test_last_logits_and_shared_parameters():
    model = tiny_model()
    kv = KVCache(model)
    assert np.shares_memory(kv.p["wte"], model.params)          # no copy on the numpy backend
    tokens = [3, 1, 4, 1, 5]
    last = kv.decode(tokens)
    np.testing.assert_allclose(last, full_logits(model, tokens)[-1], atol=TOL * 10, rtol=0)
    with pytest.raises(ValueError, match="outside"):
        KVCache(model).decode([100])


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (0.8, 5)])
def test_generate_with_and_without_cache_agree(temperature, top_k):
    model = tiny_model()
    prompt = [7, 8, 9]
    plain = generate(model, prompt, 13, np.random.default_rng(5), temperature, top_k)
    cached = generate(model, prompt, 13, np.random.default_rng(5), temperature, top_k, cache=True)
    assert cached == plain and len(plain) == 16


def test_full_cache_restarts_from_the_last_half():
    """Past max_seq_len the cache restarts with the last maxT/2 tokens: the next logits are the full
    forward's over exactly those tokens."""
    model = tiny_model(maxT=8)
    seen = []
    original = KVCache.decode

    def spy(self, tokens, all_logits=False):
        seen.append(list(np.asarray(tokens).reshape(-1)))
        return original(self, tokens, all_logits)

    KVCache.decode = spy
    try:
        out = generate(model, [1, 2, 3], 12, np.random.default_rng(0), 0.0, cache=True)
    finally:
        KVCache.decode = original
    assert len(out) == 15
    restarts = [s for s in seen if len(s) > 1][1:]                 # after the prompt's
    assert restarts and all(len(s) == 4 for s in restarts)
    # 3 prompt tokens + 5 new fill the 8 positions; token 8 is sampled from them, then the cache
    # restarts with tokens 5..8, whose full forward (greedy) gives token 9
    context = out[5:9]
    assert restarts[0] == context
    assert out[9] == int(np.argmax(full_logits(model, context)[-1]))


@pytest.fixture()
def model_file(tmp_path):
    """A tiny model with GPT-2's vocabulary, so the BPE tokenizer's prompt ids fit."""
    cfg = GPT2Config(32, 50257, 50304, 2, 2, 16)
    model = GPT2(cfg, get_backend("numpy"), 1, 1, seed=11)
    path = tmp_path / "tiny.bin"
    save_model(path, cfg, model.params_host())
    return path


def test_sample_command_prints_prompt_and_continuation(model_file, data_dir, capsys):
    argv = ["-e", str(model_file), "--prompt", "ROMEO:", "-g", "12", "--temperature", "0",
            "--bpe-dir", str(data_dir)]
    assert sample.main(argv) == 0
    cached = capsys.readouterr()
    assert cached.out.startswith("ROMEO:") and len(cached.out) > len("ROMEO:\n")
    assert "KV cache" in cached.err and "12 new tokens" in cached.err
    assert sample.main(argv + ["--no-cache"]) == 0
    plain = capsys.readouterr()
    assert plain.out == cached.out and "full forward" in plain.err


def test_sample_no_cache_takes_the_cpu_math(model_file, data_dir, capsys):
    """--cpu-math picks the full forward's math (named on the model line); greedy, both give the KV
    cache's tokens (plain NumPy, an independent path); without --no-cache or off the CPU the flag is
    one line, exit 2."""
    argv = ["-e", str(model_file), "--prompt", "ROMEO:", "-g", "8", "--temperature", "0",
            "--bpe-dir", str(data_dir), "--device", "cpu"]
    assert sample.main(argv) == 0
    cached = capsys.readouterr()
    assert "KV cache (plain NumPy)" in cached.err
    for math_ in ("exact", "fast"):
        assert sample.main(argv + ["--no-cache", "--cpu-math", math_]) == 0
        plain = capsys.readouterr()
        assert f"on numpy ({math_} CPU math); full forward" in plain.err and plain.out == cached.out
    for extra, words in ((["--cpu-math", "exact"], "only with --no-cache"),
                         (["--no-cache", "--cpu-math", "fast", "--device", "emu"],
                          "not --device emu")):
        assert sample.main(argv + extra) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and words in lines[0], lines


def test_sample_with_empty_prompt_and_several_samples(model_file, data_dir, capsys):
    assert sample.main(["-e", str(model_file), "-g", "4", "--num-samples", "2", "--bpe-dir",
                        str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2


@pytest.mark.parametrize("argv, expected", [
    (["-g", "-1"], ["-g -1", ">= 0"]),
    (["--temperature", "nan"], ["--temperature nan", "finite"]),
    (["--top-k", "-2"], ["--top-k -2"]),
    (["--num-samples", "0"], ["--num-samples 0", ">= 1"]),
    (["-e", "missing.bin"], ["missing.bin"]),
    (["--device", "tpu"], ["--device", "'tpu'"]),
])
def test_sample_bad_input_is_one_line(argv, expected, model_file, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    full = (["-e", str(model_file)] if "-e" not in argv else []) + argv
    assert sample.main(full) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(piece in lines[0] for piece in expected), lines[0]


def test_prompt_outside_the_models_vocabulary(tmp_path, data_dir, capsys):
    cfg = GPT2Config(16, 300, 384, 1, 2, 16)
    path = tmp_path / "small_vocab.bin"
    save_model(path, cfg, GPT2(cfg, get_backend("numpy"), 1, 1, seed=1).params_host())
    assert sample.main(["-e", str(path), "--prompt", "Hello world", "--bpe-dir",
                        str(data_dir)]) == 2
    assert ("--prompt: token 15496 is outside the model's vocabulary of 300"
            in capsys.readouterr().err)


@pytest.mark.parametrize("prompt", [[], ["--prompt", ""]])
def test_no_prompt_with_a_vocabulary_without_endoftext(prompt, tmp_path, data_dir, capsys):
    """No --prompt starts from <|endoftext|> (50256): a smaller vocabulary lacks it, and the one
    line says so rather than blaming a --prompt that was not given."""
    cfg = GPT2Config(16, 1000, 1024, 1, 2, 16)
    path = tmp_path / "small_vocab.bin"
    save_model(path, cfg, GPT2(cfg, get_backend("numpy"), 1, 1, seed=1).params_host())
    assert sample.main(["-e", str(path), "-g", "2", "--bpe-dir", str(data_dir)] + prompt) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and not lines[0].startswith("error: --prompt:"), lines
    assert "vocabulary of 1000 has no <|endoftext|> (token 50256) to start from" in lines[0], lines
    assert "give --prompt" in lines[0], lines


def test_the_default_llmc_model_is_fetched_like_train_does(monkeypatch, tmp_path, capsys):
    """-e gpt2_124M.bin not in checkpoints/: fetched as train's -e is; offline, one line
    says what failed."""
    from gpt2np.datasets import fetch, starter
    from gpt2np.formats import hf
    asked = []

    def offline(filename, dest_dir, **kwargs):
        asked.append(filename)
        raise fetch.FetchError(f"could not download {filename}: Name or service not "
                               "known (offline?)")

    monkeypatch.setattr(starter, "ensure", offline)
    monkeypatch.setattr(starter, "CHECKPOINTS", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert sample.main(["-e", "gpt2_124M.bin"]) == 2
    assert asked == ["gpt2_124M.bin"]
    assert capsys.readouterr().err == ("error: could not download gpt2_124M.bin: Name or service "
                                       "not known (offline?)\n")
    assert hf.is_hub_id("gpt2") and hf.is_hub_id("openai-community/gpt2-xl")
    assert (not hf.is_hub_id("model.bin") and not hf.is_hub_id("../x")
            and not hf.is_hub_id("/abs/dir"))


# ---- llm.c's sampler: its coins and its inverse-CDF rule -----------------------------------------
def xorshift_coins(state, count):
    """llm.c's random_f32 (llmc/sampler.h) in NumPy's wrapping uint64 arithmetic."""
    s, out = np.array([state], np.uint64), []
    with np.errstate(over="ignore"):
        for _ in range(count):
            s ^= s >> np.uint64(12)
            s ^= s << np.uint64(25)
            s ^= s >> np.uint64(27)
            u32 = (s * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(32)
            out.append(float(np.float32(int(u32[0] >> np.uint64(8))) / np.float32(16777216.0)))
    return out


def test_llmc_coins_are_llmc_random_f32():
    coins = LlmcCoins(1337)
    assert [coins.random() for _ in range(2000)] == xorshift_coins(1337, 2000)


def test_sample_next_picks_the_first_id_whose_cumulative_probability_exceeds_the_coin():
    logits = np.random.default_rng(0).standard_normal(500) * 3
    probs = np.exp(logits - logits.max())
    cdf = np.cumsum(probs / probs.sum())
    for coin in (0.0, 0.1234, 0.5, 0.987654, 0.999999):
        class Fixed:
            def random(self, coin=coin):
                return coin
        assert sample_next(logits, Fixed()) == int(np.argmax(cdf > coin))


def test_a_zero_state_takes_llmcs_1337():
    """xorshift keeps a state of 0 at 0 (every coin 0.0); --seed 0 samples as
    llm.c's 1337 instead."""
    zero, llmc = LlmcCoins(0), LlmcCoins(1337)
    assert [zero.random() for _ in range(5)] == [llmc.random() for _ in range(5)]


def test_sample_reproduces_the_trainers_sample_at_a_checkpoint(model_file, data_dir, tmp_path,
                                                               capsys, monkeypatch):
    """train --seed S -g G prints a sample at step N (llm.c's xorshift coins from state S, G-1 new
    tokens after <|endoftext|>); `gpt2np sample -e model_N.bin --seed S -g G-1` prints the same
    text, with the KV cache and with the full forward."""
    import train
    from gpt2np.datasets.data import write_shard
    monkeypatch.setenv("GPT2NP_BPE_DIR", str(data_dir))
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "t_train.bin", rng.integers(0, 50257, 2000))
    write_shard(tmp_path / "t_val.bin", rng.integers(0, 50257, 500))
    run = tmp_path / "run"
    flags = ["-e", model_file, "-i", tmp_path / "t_train.bin", "-j", tmp_path / "t_val.bin",
             "-b", 2, "-t", 16, "-x", 2, "-v", 0, "-s", 2, "-g", 12, "--seed", 7, "-o", run,
             "-n", 2, "--device", "cpu"]
    assert train.main([str(a) for a in flags]) == 0
    out = capsys.readouterr().out
    printed = out.split("generating:\n---\n", 1)[1].split("\n---\n", 1)[0]
    assert printed
    argv = ["-e", str(run / "model_00000002.bin"), "-g", "11", "--device", "cpu", "--bpe-dir",
            str(data_dir)]
    for flags in ([], ["--no-cache"]):
        assert sample.main(argv + ["--seed", "7", *flags]) == 0
        assert capsys.readouterr().out == printed + "\n", flags
    assert sample.main(argv + ["--seed", "8"]) == 0
    assert capsys.readouterr().out != printed + "\n"          # another state, other coins
