"""The `gpt2np` console script: one command, a subcommand per tool (each a thin dispatcher
to the tool's main).

    gpt2np train -e d12 -x 20 -o log_d12       # = python train.py ...   (llm.c's flags)
    gpt2np sample -e log_d12/model_00000020.bin --prompt "ROMEO:" -g 64
    gpt2np COMMAND --help                      # each command's flags
"""
import importlib
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed

from gpt2np.errors import ArgumentParser, BadInput, program_name, tool

# name -> (module whose main runs it, argv prefix, one line for the command list)
COMMANDS = {
    "train": ("gpt2np.cli.train", [],
              "train GPT-2 (llm.c's train_gpt2 flags; the same as python train.py)"),
    "prepare": ("gpt2np.cli.prepare", [],
                "text, tinyshakespeare, FineWeb(-Edu) or TinyStories -> llm.c token shards"),
    "fetch": ("gpt2np.cli.fetch", [],
              "download tinyshakespeare, llm.c's gpt2_124M.bin, tokenizer, BPE files, HellaSwag"),
    "compare": ("gpt2np.cli.compare", [],
                "check logits, gradients and AdamW steps against a PyTorch GPT-2"),
    "profile": ("gpt2np.cli.profile", [],
                "profile training steps: per-kernel/op table, module tree, views"),
    "plan": ("gpt2np.cli.plan", [], "plan a run: memory and time estimates (profile --plan)"),
    "nsys": ("gpt2np.cli.nsys", [], "attribute an Nsight Systems SQLite export to layers and ops"),
    "ncu": ("gpt2np.cli.ncu", [],
            "attribute an Nsight Compute export (CSV or .ncu-rep) to layers and ops"),
    "report": ("gpt2np.cli.report", [],
               "re-render a saved profile (profile.json): tables, views, plots"),
    "hf": ("gpt2np.cli.hf", [], "Hugging Face GPT-2 <-> llm.c model file: hf import, hf export"),
    "eval": ("gpt2np.cli.eval", [],
             "val loss on token shards; eval hellaswag: HellaSwag acc, acc_norm"),
    "sample": ("gpt2np.cli.sample", [], "generate text from a model (KV cache)"),
    "plot": ("gpt2np.cli.plot", [],
             "plot train/val loss and HellaSwag of runs from their main.log"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: gpt2np COMMAND [ARGS...]", "",
             "gpt2np: GPT-2 training from scratch in the spirit of llm.c (NumPy on the CPU, CUDA "
             "kernels on a GPU).",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    lines += ["", "`gpt2np COMMAND --help` shows a command's flags. Extras: pip install "
                  "'gpt2np[hf]' for hf (and -e with a Hugging Face model), 'gpt2np[plot]' for "
                  "plot, 'gpt2np[data]' for prepare fineweb.", "GPT2NP_DEBUG=1 shows tracebacks."]
    return "\n".join(lines)


def version() -> str:
    """The installed gpt2np's version."""
    try:
        return installed("gpt2np")
    except PackageNotFoundError:
        return "unknown (not installed)"


@tool
def main(argv=None):
    """Run `gpt2np COMMAND ARGS`: the command's main with ARGS, its exit code; no or an
    unknown command: exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise BadInput("no command: gpt2np COMMAND [ARGS...] with COMMAND one of "
                       f"{', '.join(COMMANDS)} (gpt2np --help)")
    if argv[0] in ("-h", "--help", "help"):
        if len(argv) > 1 and argv[0] == "help":
            return main([argv[1], "--help"])
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"gpt2np {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        if name.startswith("-"):
            ArgumentParser(prog="gpt2np").error(f"{name} before a command; usage: gpt2np "
                                                "COMMAND [ARGS...]")
        raise BadInput(f"unknown command {name!r}; the commands are "
                       f"{', '.join(COMMANDS)} (gpt2np --help)")
    module_name, prefix, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    with program_name(f"gpt2np {name}"):
        return module.main(prefix + rest)


if __name__ == "__main__":
    sys.exit(main())
