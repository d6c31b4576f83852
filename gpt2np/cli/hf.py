"""`gpt2np hf import|export`: Hugging Face GPT-2 <-> llm.c model files (gpt2np.formats.hf
does the mapping)."""
import sys
from pathlib import Path

from gpt2np.errors import ArgumentParser, BadInput, tool
from gpt2np.fileio import check_folder, removing_new_folders
from gpt2np.formats.checkpoint import load_model, save_model
from gpt2np.formats.hf import CONFIG_JSON, load_hf, write_hf_folder
from gpt2np.tensors import num_parameters

DESCRIPTION = """Hugging Face GPT-2 weights <-> llm.c model files."""


def _size(path) -> str:
    size = Path(path).stat().st_size
    return f"{size / 1e6:,.1f} MB" if size >= 1e6 else f"{size:,} bytes"


@tool
def main(argv=None):
    """gpt2np hf import|export: bad input (flags, files, an unknown or unreachable model):
    one line, exit 2."""
    p = ArgumentParser(prog="gpt2np hf", description=DESCRIPTION,
                       epilog="`gpt2np hf import --help` and `gpt2np hf export --help` show "
                              "each one's flags.")
    sub = p.add_subparsers(dest="action", metavar="{import,export}", required=True)
    imp = sub.add_parser("import", help="a transformers GPT-2 (folder or Hub id) -> "
                                        "llm.c model file", description="Read a GPT2LMHeadModel "
                         "(config.json + model.safetensors, or pytorch_model.bin with PyTorch "
                         "installed; or a Hugging Face Hub id such as gpt2, gpt2-medium, "
                         "openai-community/gpt2-xl) and write llm.c's model file.")
    imp.add_argument("source", metavar="DIR_OR_ID",
                     help="transformers model folder, or a Hub id (needs network)")
    imp.add_argument("-o", "--output", required=True,
                     help="llm.c model file to write (e.g. gpt2_124M.bin)")
    imp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                     help="fp32 = llm.c version 3 (default), bf16 = version 5")
    imp.add_argument("--revision", help="Hub revision (branch, tag or commit; default main)")
    exp = sub.add_parser("export", help="llm.c model file -> config.json + model.safetensors",
                         description="Write an llm.c model file (fp32 v3 or bf16 v5) as a "
                         "transformers GPT2LMHeadModel folder: config.json and model.safetensors "
                         "(fp32), and for GPT-2's vocabulary its tokenizer (vocab.json, merges.txt "
                         "from the BPE files that prepare uses) when they are found.")
    exp.add_argument("model", metavar="MODEL", help="llm.c model file")
    exp.add_argument("-o", "--output", required=True, help="folder to write (made if missing)")
    args = p.parse_args(argv)
    if args.action == "import":
        out = Path(args.output)
        if out.is_dir():
            raise BadInput(f"-o {out}: is a folder; expected the model file to write")
        cfg, params, folder = load_hf(args.source, args.revision)
        save_model(out, cfg, params, args.dtype)
        print(f"{folder} -> {out}: GPT-2 L={cfg.num_layers} H={cfg.num_heads} C={cfg.channels} "
              f"maxT={cfg.max_seq_len} V={cfg.vocab_size} (padded {cfg.padded_vocab_size}), "
              f"{num_parameters(cfg):,} parameters, {args.dtype} ({_size(out)})")
    else:
        model = Path(args.model)
        if model.is_dir():
            what = ("a transformers folder: `hf import` converts it to an llm.c model file"
                    if (model / CONFIG_JSON).is_file() else "a folder")
            raise BadInput(f"{args.model}: is {what}; hf export reads an llm.c model file (.bin, "
                           "as train writes)")
        check_folder("-o", args.output)
        cfg, params = load_model(args.model)
        with removing_new_folders(args.output):
            for path in write_hf_folder(args.output, cfg, params):
                print(f"wrote {path} ({_size(path)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
