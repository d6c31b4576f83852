"""llm.c's train_gpt2cu command lines work as written: every flag of its usage text is one of
train.py's, with llm.c's meaning (-h 1 HellaSwag, -f TF32, -r recompute, -ge GELU fusion, -w master
weights, -sl/-sg outlier skips, -nk/-nm checkpoint rotation, -pn/-pr/-pg/-pi multi-node), and what
gpt2np cannot do is one line."""
import pytest

import train
from gpt2np.backends import device_traits
from gpt2np.config import TrainConfig

# llm.c's GPT-2 (124M) reproduction on FineWeb (its README's command), word for word
LLMC_124M = ("-i dev/data/fineweb10B/fineweb_train_*.bin -j dev/data/fineweb10B/fineweb_val_*.bin "
             "-o log124M -e d12 -b 64 -t 1024 -d 524288 -r 1 -z 1 -c 0.1 -l 0.0006 -q 0.0 -u 700 "
             "-n 5000 -v 250 -s 20000 -h 1").split()


def test_llmc_124m_command_parses_with_llmcs_meanings():
    cfg = train.parse_config(LLMC_124M).validate()
    assert (cfg.batch_size, cfg.seq_len, cfg.total_batch_size, cfg.recompute,
            cfg.zero_stage) == (64, 1024, 524288, 1, 1)
    assert ((cfg.weight_decay, cfg.learning_rate, cfg.final_lr_frac, cfg.warmup_steps)
            == (0.1, 6e-4, 0.0, 700))
    assert ((cfg.checkpoint_every, cfg.val_every, cfg.sample_every, cfg.hellaswag_eval)
            == (5000, 250, 20000, 1))
    gpu = device_traits("cuda")
    # -h 1: HellaSwag at the -v steps
    assert cfg.with_device_defaults(gpu).hellaswag_interval == 250


def test_every_flag_of_llmcs_usage_is_taken():
    usage = ["-i", "-j", "-e", "-o", "-n", "-nk", "-nm", "-y", "-b", "-t", "-d", "-x", "-k", "-l",
             "-u", "-q", "-c", "-sl", "-sg", "-v", "-m", "-s", "-g", "-h", "-a", "-f", "-w", "-ge",
             "-z", "-r", "-pn", "-pr", "-pg", "-pi", "-ps", "-pf", "-lg"]
    ours = {action.option_strings[0] for action in train.build_parser()._actions
            if action.option_strings}
    assert set(usage) <= ours


def test_bare_h_is_help_and_h_with_a_value_is_hellaswag(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_config(["-h"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out
    assert train.parse_config(["-h", "1"]).hellaswag_eval == 1
    with pytest.raises(SystemExit) as exit_:
        train.parse_config(["-h", "2"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("argv, expected", [
    # the device's default (TF32 on a GPU with tensor cores)
    ([], None),
    (["-f", "1"], None),
    (["-f", "0"], "fp32"),                         # llm.c's -f 0: exact fp32 matmuls
    (["-f", "0", "--precision", "bf16"], "bf16"),  # -f only concerns fp32 runs (llm.c's fp32 build)
    (["-f", "0", "--precision", "fp32"], "fp32"),
])
def test_f_is_llmcs_tf32_switch(argv, expected):
    assert train.parse_config(argv).validate().requested_precision == expected


def test_hellaswag_due_as_llmc():
    ours, llmc = TrainConfig(hellaswag_every=2), TrainConfig(hellaswag_eval=1, val_every=2)
    assert [s for s in range(7) if ours.hellaswag_due(s)] == [0, 2, 4, 6]
    # llm.c: step > 0 (and the last)
    assert [s for s in range(7) if llmc.hellaswag_due(s)] == [2, 4, 6]
    assert not any(TrainConfig().hellaswag_due(s) for s in range(5))


def test_hellaswag_interval():
    assert TrainConfig(hellaswag_every=7).hellaswag_interval == 7
    assert TrainConfig(hellaswag_eval=1, val_every=20).hellaswag_interval == 20
    assert TrainConfig().with_device_defaults(device_traits("numpy")).hellaswag_interval == 0
    cpu = device_traits("numpy")
    # the CPU's -v
    assert TrainConfig(hellaswag_eval=1).with_device_defaults(cpu).hellaswag_interval == 10


@pytest.mark.parametrize("argv, says", [
    (["-f", "0", "--tf32"], "error: -f 0 with --precision tf32"),
    (["-f", "0", "--precision", "tf32"], "error: -f 0 with --precision tf32"),
    (["-pi", "tcp", "-ps", "10.0.0.1"],
     "error: -pi tcp: gpt2np's ranks find each other through MPI"),
    (["-pi", "fs", "-pf", "/shared"], "error: -pi fs: gpt2np's ranks find each other through MPI"),
    (["-ps", "10.0.0.1"], "error: -ps: gpt2np's ranks find each other through MPI"),
    (["-h", "1", "--hellaswag", "5"], "error: -h 1 with --hellaswag 5"),
    (["-h", "1", "-v", "0"], "error: -h 1 with -v 0"),
    (["-nm", "10"], "error: -nm 10 without -nk"),
    (["-nk", "2"], "error: -nk 2 without -o: -nk keeps the last checkpoints that -n writes"),
    (["-nk", "2", "-o", "run", "-n", "0"],
     "error: -nk 2 with -n 0: -nk keeps the last checkpoints"),
    (["-e", ""], "error: -e '': must be a non-empty text"),
    (["-i", ""], "error: -i '': must be a non-empty text"),
    (["-j", ""], "error: -j '': must be a non-empty text"),
    (["-sl", "-1"], "error: -sl -1"),
])
def test_what_gpt2np_cannot_do_is_one_line(argv, says, capsys):
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.strip().splitlines()) == 1, err


def test_pn_pr_that_differ_from_the_launch_are_noted_and_mpiexecs_used(tmp_path, capsys):
    import numpy as np

    from gpt2np.backends import get_backend
    from gpt2np.config import GPT2Config
    from gpt2np.datasets.data import write_shard
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.model import GPT2
    cfg = GPT2Config(32, 100, 128, 1, 2, 16)
    save_model(tmp_path / "m.bin", cfg, GPT2(cfg, get_backend("numpy"), 1, 1, seed=1).params_host())
    write_shard(tmp_path / "train.bin", np.arange(2000) % 100)
    base = ["-e", str(tmp_path / "m.bin"), "-i", str(tmp_path / "train.bin"), "-b", "2", "-t", "8",
            "-x", "1", "-s", "0", "--device", "cpu", "-pi", "mpi"]
    # equal: nothing said
    assert train.main(base + ["-pn", "1", "-pr", "0", "-pg", "8"]) == 0
    assert "note: rank" not in capsys.readouterr().out
    assert train.main(base + ["-pn", "4", "-pr", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: rank 0 of 1: -pn 4 differs from what mpiexec started; using mpiexec's 1" in out
    assert "note: rank 0 of 1: -pr 2 differs from what mpiexec started; using mpiexec's 0" in out


@pytest.mark.parametrize("spec, shape, params", [
    ("d6", (6, 6, 384, 1024), None),
    ("d12", (12, 12, 768, 1024), 124_475_904),             # llm.c's GPT-2 124M (Vp = 50304)
    # Hugging Face's gpt2-medium, 354,823,168, + 47 padded rows
    ("gpt2:d24", (24, 16, 1024, 1024), 354_871_296),
    ("d84", (84, 36, 3456, 1024), None),
    ("gpt3:c768", (12, 12, 768, 2048), 125_262_336),       # d12 with 2048 positions: + 1024 x 768
    ("gpt3:c2560", (32, 32, 2560, 2048), None)])           # head size 80
def test_llmcs_model_descriptors(spec, shape, params):
    """-e takes llm.c's model descriptors (gpt_build_from_descriptor): dL / gpt2:dL for its 8 GPT-2
    depths, gpt3:cC for its GPT-3 table (context 2048), with llm.c's layers, heads and channels."""
    from gpt2np.config import descriptor
    from gpt2np.datasets.starter import resolve_model
    from gpt2np.tensors import num_parameters
    cfg, params_, what = resolve_model(spec)
    assert params_ is None and what == f"{spec} (random init)" and cfg == descriptor(spec)
    assert (cfg.num_layers, cfg.num_heads, cfg.channels, cfg.max_seq_len) == shape
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (50257, 50304)
    if params is not None:
        assert num_parameters(cfg) == params


@pytest.mark.parametrize("spec, says", [
    ("d7",
     "-e d7: llm.c has no GPT-2 of depth 7; its model descriptors are dL or gpt2:dL (L = 6, 12,"),
    ("gpt2:d0", "-e gpt2:d0: llm.c has no GPT-2 of depth 0"),
    ("gpt3:c100", "-e gpt3:c100: llm.c has no GPT-3 of 100 channels"),
    ("gpt3:c5140",
     "-e gpt3:c5140: llm.c's head size for 5140 channels, 128, does not divide them")])
def test_a_descriptor_llmc_does_not_have_is_one_line(spec, says, capsys):
    assert train.main(["-e", spec, "-x", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and len(err.strip().splitlines()) == 1, err


def test_a_descriptor_is_random_init_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    """`-e d12 -o d12` and its `-y 1` restart: the folder d12 (the run's -o) does not turn -e d12
    into a Hugging Face folder; only a file of that name is read as a model file."""
    from gpt2np.datasets.starter import load_any_model, resolve_model
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d12").mkdir()
    cfg, params, what = resolve_model("d12")
    assert params is None and what == "d12 (random init)" and cfg.num_layers == 12
    assert load_any_model("gpt2:d6")[2] == "gpt2:d6 (random init)"
    (tmp_path / "gpt2:d6").mkdir()
    assert load_any_model("gpt2:d6")[2] == "gpt2:d6 (random init)"


def test_a_starter_pack_model_asked_by_name_is_fetched_and_never_stood_in_for(tmp_path,
                                                                              monkeypatch):
    """-e gpt2_124M_bf16.bin (missing) is fetched into checkpoints/; offline that is one error line,
    not a random d12 in its place, which only the default gpt2_124M.bin gets (with a note)."""
    from gpt2np.datasets import starter
    from gpt2np.datasets.fetch import FetchError
    monkeypatch.setattr(starter, "CHECKPOINTS", tmp_path)
    monkeypatch.chdir(tmp_path)
    asked = []

    def offline(name, folder, timeout=None):
        asked.append(name)
        raise FetchError(f"could not download {name} (offline?)")

    monkeypatch.setattr(starter, "ensure", offline)
    with pytest.raises(FetchError, match="gpt2_124M_bf16.bin"):
        starter.resolve_model("gpt2_124M_bf16.bin")
    notes = []
    monkeypatch.setattr(starter, "note", notes.append)
    cfg, params, what = starter.resolve_model("gpt2_124M.bin")
    assert (params is None and "d12 (random init; gpt2_124M.bin unavailable)" == what
            and len(notes) == 1)
    assert asked == ["gpt2_124M_bf16.bin", "gpt2_124M.bin"]
    # not a model of the starter pack: not fetched
    with pytest.raises(FileNotFoundError):
        starter.resolve_model("gpt2_tokenizer.bin")
    assert asked == ["gpt2_124M_bf16.bin", "gpt2_124M.bin"]
