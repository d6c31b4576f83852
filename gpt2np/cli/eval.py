"""Evaluate a model: `gpt2np eval [loss] -e MODEL -j PATTERN`, the mean loss over token shards.

    gpt2np eval -e model.bin -j 'data/val*.bin'          # every batch of the shards, with progress
    gpt2np eval -e gpt2 -j val.bin -b 8 -t 1024 -m 100  # a Hugging Face model, 100 batches

The loss is the one training logs as `tel` (val loss): the mean over batches of each batch's mean
next-token cross-entropy, batches of -b x -t tokens read in order from the shards (llm.c's
DataLoader). The precision is training's default on the device; a run trained with --precision bf16
(or tf32) logged its val loss in that precision, and `--precision bf16` gives it again.

    gpt2np eval hellaswag -e model.bin                     # HellaSwag acc and acc_norm
    gpt2np eval hellaswag -e model.bin -j my.jsonl -m 100 -b 16

For hellaswag, -j is a HellaSwag jsonl (default: hellaswag_val.jsonl, downloaded into the cache, see
gpt2np/datasets/cache.py), -m the max examples, -b the rows (4 per example) per forward and -t the
longest row (default: the longest in the data, at most the model's max_seq_len).
"""
import math
import sys
import time
from pathlib import Path

from gpt2np.backends import (
    device_traits,
    get_backend,
    resolve_attention,
    resolve_name,
    resolve_precision,
)
from gpt2np.datasets import hellaswag
from gpt2np.datasets.cache import checked_cache_dir
from gpt2np.datasets.data import DataLoader
from gpt2np.datasets.starter import load_any_model, resolve_data
from gpt2np.errors import ArgumentParser, BadInput, integer, tool
from gpt2np.fileio import removing_new_folders
from gpt2np.model import GPT2
from gpt2np.train.evaluate import eval_loss

TASKS = ("loss", "hellaswag")
# -e of the commands that read a model (eval, sample)
MODEL_HELP = ("the model: an llm.c model file (.bin, as train writes; gpt2_124M.bin is fetched "
              "if missing), llm.c's descriptor for a random init (d6..d84, gpt2:dL, gpt3:cC), a "
              "Hugging Face GPT-2 folder (config.json + model.safetensors, as transformers and "
              "`gpt2np hf export` write it) or a Hugging Face Hub id (gpt2, "
              "openai-community/gpt2-medium; downloaded when online; needs pip install "
              "'gpt2np[hf]')")


def parse_args(argv):
    """The flags of `gpt2np eval`, each checked (BadInput names the first that is not allowed)."""
    p = ArgumentParser(prog="gpt2np eval", description=__doc__.split("\n")[0],
                       epilog="eval hellaswag: -j a HellaSwag jsonl (default hellaswag_val.jsonl, "
                              "fetched into the cache), -m max examples, -b rows per forward "
                              "(4 per example).")
    p.add_argument("task", nargs="?", default="loss", choices=TASKS,
                   help="loss (default): mean loss on -j; hellaswag: acc and acc_norm on HellaSwag")
    p.add_argument("-e", "--model", required=True, help=MODEL_HELP)
    p.add_argument("-j", "--val-data", metavar="PATTERN",
                   help="token shards (glob; default: the tinyshakespeare val split, prepared on "
                        "first use); hellaswag: a jsonl file (default: "
                        "hellaswag_val.jsonl in the cache)")
    p.add_argument("-b", "--batch-size", type=int, default=4, help="batch size B (default 4)")
    p.add_argument("-t", "--seq-len", type=int, help="sequence length T (default 64 on the CPU, "
                   "1024 on a GPU; at most the model's max_seq_len)")
    p.add_argument("-m", "--val-max-batches", type=int, default=-1,
                   help="this many batches, as train.py's -m (more than there are wrap around; "
                        "hellaswag: at most this many examples), -1 = all (default -1)")
    p.add_argument("--dir", help="hellaswag: the download cache (default: $GPT2NP_CACHE, else "
                                 "the user cache dir)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "numpy", "cuda", "emu"),
                   help="auto = cuda if there is a GPU, else cpu; emu = the CUDA kernels on the "
                        "CPU emulator (default auto); training's precision and attention "
                        "defaults for the device")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"),
                   help="the model's math, as train.py's --precision: fp32, tf32 (TF32 tensor "
                        "cores; a GPU or the emulator) or bf16 (bf16 storage, fp32 math: as a "
                        "run trained with --precision bf16 logged its val loss) (default: "
                        "training's on the device: tf32 on a GPU with tensor cores, fp32 "
                        "elsewhere)")
    p.add_argument("--cpu-math", choices=("fast", "exact"),
                   help="the numpy backend's math, as train.py's --cpu-math: fast (the default) or "
                        "exact (bitwise the NumPy reference, as a run trained with --cpu-math "
                        "exact logged its val loss)")
    args = p.parse_args(argv)
    integer(1).check("-b", args.batch_size, "the batch size B")
    if args.seq_len is not None:
        integer(1).check("-t", args.seq_len, "the sequence length T")
    integer(1, also=(-1,), words="-1 (all) or an integer >= 1").check("-m", args.val_max_batches,
                                                                      "the max val batches")
    check_cpu_math(args)
    return args


@tool
def main(argv=None):
    """The val loss of a model on token shards; bad flags or files: one line, exit 2."""
    args = parse_args(argv)
    if args.task == "hellaswag":
        return eval_hellaswag(args)
    if args.dir:
        raise BadInput(f"--dir {args.dir}: only for eval hellaswag (the download cache of "
                       "hellaswag_val.jsonl)")
    cfg, params, desc = load_any_model(args.model)
    backend, attention = device_backend(args, cfg)
    T = args.seq_len or min(1024 if backend.launches_kernels else 64, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise BadInput(f"-t {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    _, val_pattern = resolve_data(None, None) if args.val_data is None else (None, args.val_data)
    loader = DataLoader(val_pattern, args.batch_size, T, vocab_size=cfg.vocab_size)
    model = GPT2(cfg, backend, args.batch_size, T, attention=attention)
    model.load_params(params)
    started = time.perf_counter()
    loss, batches = eval_loss(model, loader, args.val_max_batches)
    seconds = time.perf_counter() - started
    tokens = batches * args.batch_size * T
    print(f"model {desc} on {backend_words(backend)}")
    print(f"data {val_pattern}: {len(loader.files)} shard(s), {loader.num_tokens:,} tokens")
    print(f"val loss {loss:.6f} (perplexity {math.exp(min(loss, 700)):.2f}) over {batches} batches "
          f"of B={args.batch_size} x T={T} = {tokens:,} tokens in {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):,.0f} tok/s)")
    return 0


def device_backend(args, cfg):
    """(backend, attention) for --device, --precision and --cpu-math, with training's defaults on
    the device (resolve_precision, resolve_attention); a note on stderr where the precision asked
    for cannot run there."""
    name = resolve_name(args.device)
    precision, note = resolve_precision(name, args.precision)
    if note:
        print(f"note: {note}", file=sys.stderr)
    backend = get_backend(name, precision, **({"math": args.cpu_math} if args.cpu_math else {}))
    return backend, resolve_attention(backend, cfg.channels // cfg.num_heads)[0]


def check_cpu_math(args):
    """--cpu-math only where the model runs on the numpy backend: else one line (BadInput),
    before any loading."""
    if args.cpu_math and not device_traits(args.device).has_cpu_math:
        raise BadInput(f"--cpu-math {args.cpu_math}: only for the CPU (numpy backend), not "
                       f"--device {args.device}")


def backend_words(backend):
    """'numpy (fast CPU math)', 'numpy (fast CPU math, bf16)', 'cuda (tf32)', 'cuda': where and in
    what precision the model ran, as the output line says it."""
    details = [f"{backend.math} CPU math"] if getattr(backend, "math", None) else []
    if backend.precision != "fp32":
        details.append(backend.precision)
    return f"{backend.name} ({', '.join(details)})" if details else backend.name


def eval_hellaswag(args):
    """gpt2np eval hellaswag: acc and acc_norm of -e on the examples of -j."""
    # the files and folders first, before a model is loaded or anything downloaded
    if args.val_data and args.dir:
        raise BadInput(f"--dir {args.dir}: the download cache of hellaswag_val.jsonl, not used "
                       f"with -j {args.val_data}; give one or the other")
    if args.val_data and Path(args.val_data).is_dir():
        raise BadInput(f"-j {args.val_data}: is a folder; eval hellaswag reads a "
                       "HellaSwag jsonl file")
    if args.val_data and not Path(args.val_data).is_file():
        raise BadInput(f"-j {args.val_data}: no such file; eval hellaswag reads a "
                       "HellaSwag jsonl file")
    cache = None if args.val_data else checked_cache_dir(args.dir)
    cfg, params, desc = load_any_model(args.model)
    if cfg.vocab_size < 50257:
        raise BadInput(f"-e {args.model}: vocab_size {cfg.vocab_size}; HellaSwag is tokenized with "
                       "GPT-2's 50257 tokens")
    try:
        # a failed download leaves no empty cache folder behind
        with removing_new_folders(cache):
            path, examples = hellaswag.load(args.val_data, max_examples=args.val_max_batches,
                                            cache=cache, local_flag="-j")
    except hellaswag.BadExamples as e:
        raise BadInput(f"-j {e}" if args.val_data else str(e)) from None
    T = args.seq_len or min(hellaswag.longest_row(examples) - 1, cfg.max_seq_len)
    if T > cfg.max_seq_len:
        raise BadInput(f"-t {T}: longer than the model's max_seq_len {cfg.max_seq_len}")
    backend, attention = device_backend(args, cfg)
    model = GPT2(cfg, backend, args.batch_size, T, attention=attention)
    model.load_params(params)
    started = time.perf_counter()
    result = hellaswag.evaluate(model, examples)
    seconds = time.perf_counter() - started
    print(f"model {desc} on {backend_words(backend)}")
    print(f"data {path}: {result.n:,} examples, rows of up to {T + 1} tokens, "
          f"B={args.batch_size} rows a forward")
    print(f"hellaswag acc {result.correct}/{result.n} = {result.acc:.4f} | acc_norm "
          f"{result.correct_norm}/{result.n} = {result.acc_norm:.4f} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
