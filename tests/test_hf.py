"""gpt2np hf import/export against transformers itself: a small random GPT2LMHeadModel saved with
save_pretrained is imported into an llm.c model file whose logits (numpy backend) match
transformers', exported back, loaded by GPT2LMHeadModel.from_pretrained and gives the same logits
again. Bad folders and offline Hub ids: one line."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.cli import hf as hf_cli
from gpt2np.datasets import starter
from gpt2np.formats import hf
from gpt2np.formats.checkpoint import load_model, read_model_header
from gpt2np.model import GPT2
from gpt2np.tensors import views

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("huggingface_hub")

REPO = Path(__file__).resolve().parent.parent
V, MAXT, C, L, NH = 300, 32, 32, 2, 4          # V pads to 384: the padding rows are exercised


def one_error_line(err):
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(folder, GPT2LMHeadModel): random init, every weight perturbed so that a swapped,
    untransposed or dropped tensor shows in the logits; saved with save_pretrained
    (model.safetensors, lm_head tied)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=MAXT, n_embd=C, n_layer=L, n_head=NH,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path_factory.mktemp("hf_model")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, V, (2, MAXT))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def our_logits(path, tokens):
    cfg, params = load_model(path)
    model = GPT2(cfg, get_backend("numpy"), *tokens.shape)
    model.load_params(params)
    model.forward(tokens)
    return model.logits_host()[:, :, :cfg.vocab_size]


def test_import_gives_transformers_logits_and_export_loads_back(hf_model, tokens, tmp_path, capsys):
    folder, model = hf_model
    assert (folder / "model.safetensors").is_file()
    expected = hf_logits(model, tokens)
    out = tmp_path / "model.bin"
    assert hf_cli.main(["import", str(folder), "-o", str(out)]) == 0
    assert "V=300 (padded 384)" in capsys.readouterr().out
    cfg, version = read_model_header(out)
    assert (version == 3
            and (cfg.vocab_size, cfg.padded_vocab_size, cfg.max_seq_len) == (V, 384, MAXT))
    assert (cfg.num_layers, cfg.num_heads, cfg.channels) == (L, NH, C)
    _, params = load_model(out)
    p = views(params, GPT2(cfg, get_backend("numpy"), 1, 1).param_shapes)
    # llm.c's zero padding rows
    assert not p["wte"][V:].any()
    np.testing.assert_array_equal(p["qkvw"][1],
                                  model.transformer.h[1].attn.c_attn.weight.detach().numpy().T)
    ours = our_logits(out, tokens)
    assert np.abs(ours - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())

    exported = tmp_path / "exported"
    assert hf_cli.main(["export", str(out), "-o", str(exported)]) == 0
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    back, info = transformers.GPT2LMHeadModel.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    again = hf_logits(back.eval(), tokens)
    assert np.abs(again - ours).max() <= 1e-4 * max(1.0, np.abs(ours).max())
    # and the export imports to the same bytes
    assert hf_cli.main(["import", str(exported), "-o", str(tmp_path / "again.bin")]) == 0
    assert (tmp_path / "again.bin").read_bytes() == out.read_bytes()


def test_pytorch_model_bin_and_old_names(hf_model, tmp_path):
    """pytorch_model.bin (read with torch), keys without the transformer. prefix, the old attn.bias
    buffers and a stored lm_head.weight: the same parameters as the safetensors file."""
    folder, model = hf_model
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((folder / "config.json").read_text())
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
    for l in range(L):
        state[f"h.{l}.attn.bias"] = torch.tril(torch.ones(MAXT, MAXT)).view(1, 1, MAXT, MAXT)
        state[f"h.{l}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, old / "pytorch_model.bin")
    cfg_a, params_a, _ = hf.load_hf(str(old))
    cfg_b, params_b, _ = hf.load_hf(str(folder))
    assert cfg_a == cfg_b
    np.testing.assert_array_equal(params_a, params_b)


def test_bf16_import_and_dtype_flag(hf_model, tmp_path):
    folder, model = hf_model
    half = tmp_path / "bf16"
    # the module's model stays fp32
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(half)
    _, params, _ = hf.load_hf(str(half))
    _, exact, _ = hf.load_hf(str(folder))
    assert np.abs(params - exact).max() <= 2 ** -8 * np.abs(exact).max()
    assert hf_cli.main(["import", str(folder), "-o", str(tmp_path / "m5.bin"), "--dtype",
                        "bf16"]) == 0
    assert read_model_header(tmp_path / "m5.bin")[1] == 5


def test_sample_and_eval_take_a_transformers_folder_as_e(hf_model, tmp_path):
    folder, _ = hf_model
    cfg, params, desc = starter.load_any_model(str(folder))
    assert cfg.vocab_size == V and "Hugging Face" in desc
    _, from_file, _ = hf.load_hf(str(folder / "model.safetensors"))
    np.testing.assert_array_equal(params, from_file)


def bad_folder(tmp_path, hf_model, config_changes=None, drop=None):
    folder, _ = hf_model
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((folder / "config.json").read_text()) | (config_changes or {})
    (bad / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    if drop:
        tensors.pop(drop)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("changes, drop, expected", [
    ({"model_type": "llama"}, None, ["model_type 'llama'", "GPT-2"]),
    ({"activation_function": "relu"}, None, ["activation_function 'relu'", "tanh"]),
    ({"n_inner": 100}, None, ["n_inner 100"]),
    ({"n_embd": 64}, None, ["shape", "needs"]),
    ({}, "transformer.h.1.mlp.c_fc.bias", ["transformer.h.1.mlp.c_fc.bias", "missing"]),
])
def test_bad_folders_are_one_line(hf_model, tmp_path, capsys, changes, drop, expected):
    bad = bad_folder(tmp_path, hf_model, changes, drop)
    assert hf_cli.main(["import", str(bad), "-o", str(tmp_path / "x.bin")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert all(piece in line for piece in expected), line
    assert not (tmp_path / "x.bin").exists()


@pytest.mark.parametrize("value, tensor, where, llmc_name", [
    # Conv1D (in, out); fcw[1] (out, in)
    (np.nan, "transformer.h.1.mlp.c_fc.weight", (3, 5), "fcw[1, 5, 3]"),
    (-np.inf, "transformer.h.1.mlp.c_fc.weight", (3, 5), "fcw[1, 5, 3]"),
    # with a stored lm_head.weight too
    (np.nan, "transformer.wte.weight", (7, 2), "wte[7, 2]"),
])
def test_nan_or_inf_weights_are_one_line_as_for_an_llmc_file(hf_model, tmp_path, capsys, value,
                                                             tensor, where, llmc_name):
    """A folder with a NaN or infinite weight is refused as an llm.c model file with one is
    (checkpoint's check_finite_params: the file and the tensor), by hf import and by eval's -e (it
    used to give `val loss nan`)."""
    from safetensors.numpy import load_file, save_file

    from gpt2np.cli import eval as evaluate
    from gpt2np.datasets.data import write_shard
    bad = bad_folder(tmp_path, hf_model)
    tensors = load_file(bad / "model.safetensors")
    tensors[tensor][where] = value
    if tensor == "transformer.wte.weight":
        # tied, NaN and all: not "differs from wte"
        tensors["lm_head.weight"] = tensors[tensor].copy()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    expected = f"{bad / 'model.safetensors'}: weight {llmc_name} is {np.float32(value)}"
    assert hf_cli.main(["import", str(bad), "-o", str(tmp_path / "x.bin")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line and line.endswith("not a usable model"), line
    assert not (tmp_path / "x.bin").exists()
    write_shard(tmp_path / "val.bin", np.arange(200) % V)
    assert evaluate.main(["-e", str(bad), "-j", str(tmp_path / "val.bin"), "-m", "1", "-t",
                          "16"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line, line


@pytest.mark.parametrize("argv, expected", [
    (["import", "no/such/./dir", "-o", "x.bin"], ["no/such/./dir", "no such folder"]),
    (["import", "."], ["-o"]),
    (["export", "missing.bin", "-o", "out"], ["missing.bin", "no such model file"]),
    (["convert"], ["invalid choice", "'convert'"]),
])
def test_bad_flags_are_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hf_cli.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert all(piece in line for piece in expected), line


def test_a_file_or_folder_of_the_wrong_kind_is_one_line(hf_model, tmp_path, capsys, monkeypatch):
    folder, _ = hf_model
    monkeypatch.chdir(tmp_path)
    assert hf_cli.main(["import", str(folder), "-o", "m.bin"]) == 0
    capsys.readouterr()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for argv, expected in (
            (["import", "m.bin", "-o", "x.bin"],
             ["m.bin: is a file (an llm.c model file)", "transformers GPT-2 folder", "Hub id"]),
            (["import", "notes.txt", "-o", "x.bin"],
             ["notes.txt: is a file;", "transformers GPT-2 folder"]),
            (["export", "empty", "-o", "out"], ["empty: is a folder", "llm.c model file"]),
            (["export", str(folder), "-o", "out"], ["is a transformers folder", "hf import"]),
            (["export", "m.bin", "-o", "notes.txt/out"],
             ["-o notes.txt/out", "notes.txt is a file"])):
        assert hf_cli.main(argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert all(piece in line for piece in expected), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "m.bin", "notes.txt"]
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    # -e of the other commands: the same
    with pytest.raises(ValueError, match="model.safetensors: is a file;"):
        # (no config.json beside it)
        starter.load_any_model(str(tmp_path / "model.safetensors"))


def test_a_hub_id_offline_says_so_in_one_line(tmp_path):
    """Through the real huggingface_hub, offline (HF_HUB_OFFLINE=1, an empty cache):
    one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "GPT2NP_DEBUG"} | {
        "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "gpt2np", "hf", "import", "gpt2", "-o",
                           str(tmp_path / "g.bin")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert "gpt2" in line and "offline" in line, line


def test_a_mistyped_descriptor_offline_also_lists_the_descriptors(monkeypatch):
    """-e d6x reads as a Hub id; offline its one line also says it is none of llm.c's descriptors (a
    Hub id that does not look like one does not)."""
    def offline(repo_id, revision=None):
        raise hf.HubError(f"{repo_id}: not a local folder, and the Hugging Face Hub cannot be "
                          "reached (offline?)")

    monkeypatch.setattr(hf, "download_from_hub", offline)
    for spec in ("d6x", "d12b"):
        with pytest.raises(hf.HubError, match=rf"^{spec}: not a local folder.*; as llm.c's model "
                           r"descriptor it is none of dL or gpt2:dL \(L = 6, 12"):
            starter.load_any_model(spec)
    with pytest.raises(hf.HubError) as caught:
        starter.load_any_model("gpt2-foo")
    assert "descriptor" not in str(caught.value)


def test_export_with_gpt2s_vocabulary_carries_the_tokenizer(tmp_path, data_dir, monkeypatch):
    """A model with GPT-2's 50257 tokens: the export holds vocab.json + merges.txt, AutoTokenizer
    reads them as tiktoken does, and transformers' greedy generate continues a prompt as
    gpt2np's sampler does."""
    from gpt2np.config import GPT2Config
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.formats.tokenizer import get_encoding
    from gpt2np.generate import generate
    monkeypatch.setenv("GPT2NP_BPE_DIR", str(data_dir))
    cfg = GPT2Config(32, 50257, 50304, 2, 2, 16)
    model = GPT2(cfg, get_backend("numpy"), 1, 32, seed=2)
    save_model(tmp_path / "m.bin", cfg, model.params_host())
    assert hf_cli.main(["export", str(tmp_path / "m.bin"), "-o", str(tmp_path / "out")]) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "merges.txt", "model.safetensors", "vocab.json"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    enc = get_encoding(data_dir)
    text = "ROMEO: Hello, world"
    assert tok.encode(text) == enc.encode_ordinary(text)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    prompt = enc.encode_ordinary("ROMEO:")
    with torch.no_grad():
        theirs = back.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               pad_token_id=tok.eos_token_id)[0].tolist()
    ours = generate(model, prompt, 8, np.random.default_rng(0), 0.0, cache=True)
    assert ours == theirs


def test_train_takes_a_transformers_folder_as_e(hf_model, tmp_path, capsys):
    """train -e DIR: the imported weights, validated once (-x 0) with the loss
    transformers gives."""
    import train
    from gpt2np.datasets.data import write_shard
    folder, model = hf_model
    tokens = np.random.default_rng(3).integers(0, V, 2 * 16 + 1)
    write_shard(tmp_path / "val.bin", tokens)
    argv = ["-e", str(folder), "-i", str(tmp_path / "val.bin"), "-j", str(tmp_path / "val.bin"),
            "-x", "0", "-b", "2", "-t", "16", "-s", "0", "-v", "1", "-m", "1", "--device", "cpu"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{folder} (Hugging Face)" in out
    x = torch.tensor(tokens[:-1].reshape(2, 16).astype(np.int64))
    y = torch.tensor(tokens[1:].reshape(2, 16).astype(np.int64))
    with torch.no_grad():
        logits = model(x).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1)).item()
    assert float(out.split("val loss ")[1].split()[0]) == pytest.approx(expected, abs=1e-4)
