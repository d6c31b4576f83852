"""train.py --profile N and python -m gpt2np.profiling.profiler print the profiler's views of the
last profiled step and write its files; on the emulated CUDA path every title line says so."""
import json

from test_train import base_args, run, tiny_model, tiny_shards  # noqa: F401  (fixtures)

from gpt2np.profiling.render import report
from gpt2np.profiling.render import views as V


def test_train_profile_prints_the_views_and_writes_the_files(tiny_model, tiny_shards, tmp_path,
                                                             capsys):
    device = "cpu"
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 3, "-v", 0,
                                                               "--profile", 1, "-o", tmp_path],
                         capsys)
    assert code == 0, err
    for title in ("Model summary: memory by buffer",
                  "GPT-2 modules: parameters and time", "Phases:",
                  "activities", "User ranges, PyTorch profiler layout", "Communication: none"):
        assert title in out
    titles = [line for line in out.splitlines()
              if line.startswith(("Model summary", "GPT-2 modules", "Phases", "GPU activities",
                                  "API calls", "User ranges"))]
    assert all(line.endswith(f"[{report.EMULATED_NOTE}]") == (device == "emu")
               for line in titles), titles
    folder = tmp_path / "profile"
    profile, _ = V.read_profile(str(folder / "profile.json"))
    assert (profile.memory["buffers"][0]["buffer"] == "parameters"
            and profile.meta["module_params"]["wpe"] > 0)
    assert {r.step for r in profile.records} == {1}
    doc = json.load(open(folder / "views.json"))
    assert set(V.VIEWS) - {"kernels", "layers", "ops", "top_kernels"} <= set(doc["views"])


def test_profiler_tool_on_the_emulator_prints_every_view_labelled(tiny_model, tmp_path, capsys):
    from gpt2np.cli.profile import main
    assert main(["-e", str(tiny_model), "-b", "1", "-t", "8", "--device", "emu", "--views", "all",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    blocks = [b for b in out.split("\n\n") if b.strip()]
    titles = [b.splitlines()[0] for b in blocks]          # the "wrote ..." line ends the last block
    assert len(titles) >= len(V.VIEWS)
    assert all(t.endswith(f"[{report.EMULATED_NOTE}]") for t in titles), titles
    assert "[CUDA memcpy HtoD]" in out and "cuLaunchKernel" in out and "nvtx_kern_sum" in out


def test_train_profile_profiles_at_the_runs_own_precision(tiny_model, tiny_shards, tmp_path,
                                                          capsys):
    """--profile profiles the backend the run trains on, so at its precision; the views'
    titles say which."""
    code, out, err = run(base_args(tiny_model, tiny_shards) + [
        "-x", 3, "-v", 0, "--profile", 1, "--precision", "bf16", "-o", tmp_path], capsys)
    assert code == 0, err
    assert "CPU activities (NumPy ops; no device, so no copies), precision bf16; timing:" in out
    profile, _ = V.read_profile(str(tmp_path / "profile" / "profile.json"))
    assert profile.meta["precision"] == "bf16"
