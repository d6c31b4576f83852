"""Hugging Face GPT-2 weights <-> llm.c model files.

    gpt2np hf import DIR_OR_ID -o model.bin    # a GPT2LMHeadModel folder or a Hub id (gpt2, ...)
    gpt2np hf export model.bin -o DIR          # config.json + model.safetensors for transformers

A GPT2LMHeadModel folder holds config.json and model.safetensors (or sharded safetensors with their
index, or pytorch_model.bin, read only when PyTorch is installed). transformers' Conv1D stores a
weight as (in_features, out_features); llm.c stores (out_features, in_features), so c_attn, c_proj
and c_fc are transposed.
The attention mask buffers (attn.bias, attn.masked_bias) in older files are not parameters;
lm_head.weight is wte (tied). llm.c pads the vocabulary to a multiple of 128 rows (50257 -> 50304)
with zeros. Import writes fp32 (llm.c version 3; --dtype bf16 writes version 5); export writes fp32
safetensors, and GPT-2's tokenizer files (vocab.json, merges.txt) when the model has GPT-2's
vocabulary and the BPE files are found.

A Hub id is downloaded with huggingface_hub into its cache (HF_HOME); offline, one line says so.
Needs the `hf` extra: pip install 'gpt2np[hf]' (safetensors, huggingface_hub).
"""
import json
import re
import sys
from pathlib import Path

import numpy as np

from gpt2np.config import GPT2Config, pad_vocab
from gpt2np.errors import BadInput
from gpt2np.fileio import atomic_write, check_folder
from gpt2np.formats.checkpoint import MODEL_MAGIC, bf16_to_fp32, check_finite_params
from gpt2np.formats.tokenizer import GPT2_VOCAB_SIZE, TokenizerNotFoundError, find_tokenizer_files
from gpt2np.tensors import PARAM_NAMES, num_parameters, param_shapes, views

INSTALL = "pip install 'gpt2np[hf]'"
CONFIG_JSON = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
# GELU's tanh approximation under its transformers names (llm.c's gelu); "gelu"
# (erf) is another function
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# llm.c's and the numpy backend's LayerNorm epsilon
LAYER_NORM_EPS = 1e-5
# llm.c tensor -> (transformers name without the "transformer." prefix, Conv1D weight to transpose)
HF_NAMES = {
    "wte": ("wte.weight", False), "wpe": ("wpe.weight", False),
    "ln1w": ("h.{l}.ln_1.weight", False), "ln1b": ("h.{l}.ln_1.bias", False),
    "qkvw": ("h.{l}.attn.c_attn.weight", True), "qkvb": ("h.{l}.attn.c_attn.bias", False),
    "attprojw": ("h.{l}.attn.c_proj.weight", True), "attprojb": ("h.{l}.attn.c_proj.bias", False),
    "ln2w": ("h.{l}.ln_2.weight", False), "ln2b": ("h.{l}.ln_2.bias", False),
    "fcw": ("h.{l}.mlp.c_fc.weight", True), "fcb": ("h.{l}.mlp.c_fc.bias", False),
    "fcprojw": ("h.{l}.mlp.c_proj.weight", True), "fcprojb": ("h.{l}.mlp.c_proj.bias", False),
    "lnfw": ("ln_f.weight", False), "lnfb": ("ln_f.bias", False),
}
PER_LAYER = tuple(name for name in PARAM_NAMES if "{l}" in HF_NAMES[name][0])
# causal-mask buffers in older checkpoints
BUFFERS = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
# a Hub repo id: NAME or OWNER/NAME (letters, digits, - _ .), not a path that merely does not exist
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


class HubError(OSError):
    """A Hub download failed; the message is one line naming the repo and the reason."""


# ---- the mapping ---------------------------------------------------------------------------------
def config_from_hf(hf: dict, where="config.json") -> GPT2Config:
    """llm.c's GPT2Config for a transformers GPT-2 config.json; ValueError naming what
    llm.c's GPT-2 lacks."""
    def need(key, default=None):
        value = hf.get(key, default)
        if value is None:
            raise ValueError(f"{where}: {key} is missing")
        return value

    model_type = hf.get("model_type")
    if model_type != "gpt2":
        raise ValueError(f"{where}: model_type {model_type!r} is not 'gpt2': only GPT-2 maps "
                         "onto llm.c's model")
    C, L, NH = int(need("n_embd")), int(need("n_layer")), int(need("n_head"))
    maxT, V = int(need("n_positions", hf.get("n_ctx"))), int(need("vocab_size"))
    unsupported = [
        (hf.get("n_inner") not in (None, 4 * C),
         f"n_inner {hf.get('n_inner')} (llm.c's MLP is 4*n_embd = {4 * C})"),
        (hf.get("activation_function", "gelu_new") not in TANH_GELUS,
         f"activation_function {hf.get('activation_function')!r} "
         "(llm.c's GELU is the tanh form: gelu_new)"),
        (not np.isclose(float(hf.get("layer_norm_epsilon", LAYER_NORM_EPS)),
                        LAYER_NORM_EPS, rtol=1e-6, atol=0),
         f"layer_norm_epsilon {hf.get('layer_norm_epsilon')} (llm.c's is {LAYER_NORM_EPS:g})"),
        (not hf.get("scale_attn_weights", True),
         "scale_attn_weights false (llm.c scales by 1/sqrt(head size))"),
        (bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
         "scale_attn_by_inverse_layer_idx true"),
        (bool(hf.get("add_cross_attention", False)), "add_cross_attention true"),
        (not hf.get("tie_word_embeddings", True),
         "tie_word_embeddings false (llm.c's lm_head is wte)"),]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{where}: {what}: llm.c's GPT-2 has no such variant")
    try:
        return GPT2Config(maxT, V, pad_vocab(V), L, NH, C)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def config_to_hf(cfg: GPT2Config) -> dict:
    """config.json for transformers' GPT2LMHeadModel (no dropout: llm.c trains without it)."""
    hf = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels, "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "torch_dtype": "float32",}
    # GPT-2's <|endoftext|>, when the vocabulary has it (transformers' default 50256
    # would be out of range)
    hf["bos_token_id"] = hf["eos_token_id"] = 50256 if cfg.vocab_size > 50256 else None
    return hf


def hf_to_llmc(state: dict, cfg: GPT2Config, where="the checkpoint") -> np.ndarray:
    """The flat float32 llm.c parameters from a transformers GPT-2 state dict (names with or without
    the "transformer." prefix; host arrays). Missing, unexpected or misshapen tensors:
    ValueError naming them."""
    # names as the file has
    prefix = "transformer." if any(k.startswith("transformer.") for k in state) else ""
    state = {(k[len("transformer."):] if k.startswith("transformer.") else k): v
             for k, v in state.items()}
    lm_head = state.pop("lm_head.weight", None)
    for name in [k for k in state if BUFFERS.match(k)]:
        del state[name]
    flat = np.zeros(num_parameters(cfg), np.float32)
    dst = views(flat, param_shapes(cfg))
    used = set()

    def take(hf_name, shape, transpose):
        if hf_name not in state:
            raise ValueError(f"{where}: tensor {prefix}{hf_name} is missing")
        used.add(hf_name)
        value = np.asarray(state[hf_name], dtype=np.float32)
        value = value.T if transpose else value
        if value.shape != shape:
            stored = value.T.shape if transpose else value.shape
            want = shape[::-1] if transpose else shape
            raise ValueError(f"{where}: tensor {prefix}{hf_name} has shape {stored}, config.json's "
                             f"model needs {want}")
        return value

    V = cfg.vocab_size
    for name in PARAM_NAMES:
        hf_name, transpose = HF_NAMES[name]
        if name in PER_LAYER:
            for l in range(cfg.num_layers):
                dst[name][l] = take(hf_name.format(l=l), dst[name].shape[1:], transpose)
        elif name == "wte":
            # rows V..Vp stay zero (llm.c's padding)
            dst["wte"][:V] = take(hf_name, (V, cfg.channels), False)
        else:
            dst[name][...] = take(hf_name, dst[name].shape, transpose)
    extra = sorted(set(state) - used)
    if extra:
        raise ValueError(f"{where}: unexpected tensor {prefix}{extra[0]}"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                         + ": not a GPT2LMHeadModel")
    # equal_nan: a NaN in both is read_hf_folder's to name (the same NaN weight), not a difference
    if lm_head is not None and not np.array_equal(np.asarray(lm_head, np.float32), dst["wte"][:V],
                                                  equal_nan=True):
        raise ValueError(f"{where}: lm_head.weight differs from wte.weight: "
                         "llm.c's GPT-2 ties them")
    return flat


def llmc_to_hf(cfg: GPT2Config, params) -> dict:
    """{transformers name: float32 array} of GPT2LMHeadModel for llm.c's flat parameters (lm_head is
    tied: not stored, as save_pretrained does; the padded vocabulary rows are dropped)."""
    src = views(np.asarray(params, np.float32), param_shapes(cfg))
    out = {}
    for name in PARAM_NAMES:
        hf_name, transpose = HF_NAMES[name]
        if name in PER_LAYER:
            for l in range(cfg.num_layers):
                value = src[name][l]
                out["transformer."
                    + hf_name.format(l=l)] = np.ascontiguousarray(value.T if transpose else value)
        elif name == "wte":
            out["transformer." + hf_name] = np.ascontiguousarray(src["wte"][:cfg.vocab_size])
        else:
            out["transformer." + hf_name] = np.ascontiguousarray(src[name])
    return out


# ---- files ---------------------------------------------------------------------------------------
def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError("reading and writing safetensors needs the safetensors "
                          f"package: {INSTALL}") from None
    return safetensors


def read_safetensors(path) -> dict:
    """{name: numpy array} of a .safetensors file; bf16 tensors are widened to float32 exactly."""
    st = _safetensors()
    out, bf16 = {}, []
    try:
        with st.safe_open(str(path), framework="np") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype() == "BF16":       # NumPy has no bfloat16
                    bf16.append(name)
                else:
                    out[name] = f.get_tensor(name)
        if bf16:
            for name, spec in st.deserialize(Path(path).read_bytes()):
                if name in bf16:
                    bits = np.frombuffer(bytes(spec["data"]), "<u2").reshape(spec["shape"])
                    out[name] = bf16_to_fp32(bits)
    except (st.SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file "
                         f"({' '.join(str(e).split())})") from None
    return out


def read_pytorch_bin(path) -> dict:
    """{name: numpy array} of a pytorch_model.bin (needs PyTorch; weights only, no code is run)."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path}: reading pytorch_model.bin needs PyTorch (pip install torch); a "
                          f"folder with model.safetensors needs only {INSTALL}") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        # torch raises RuntimeError, pickle errors, ... for a bad file
        raise ValueError(f"{path}: not a readable PyTorch state dict "
                         f"({' '.join(str(e).split())[:200]})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return {k: v.detach().float().numpy() for k, v in state.items() if hasattr(v, "detach")}


def read_hf_folder(folder) -> tuple:
    """(GPT2Config, flat float32 params) of a GPT2LMHeadModel folder (config.json and weights)."""
    folder = Path(folder)
    config_path = folder / CONFIG_JSON
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG_JSON}: not a transformers model folder")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    cfg = config_from_hf(hf, str(config_path))
    if (folder / SAFETENSORS).is_file():
        source, state = folder / SAFETENSORS, read_safetensors(folder / SAFETENSORS)
    elif (folder / SAFETENSORS_INDEX).is_file():
        source = folder / SAFETENSORS_INDEX
        try:
            files = sorted(set(json.loads(source.read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{source}: not a safetensors index "
                             f"({type(e).__name__}: {e})") from None
        state = {}
        for name in files:
            state.update(read_safetensors(folder / name))
    elif (folder / PYTORCH_BIN).is_file():
        source, state = folder / PYTORCH_BIN, read_pytorch_bin(folder / PYTORCH_BIN)
    else:
        raise FileNotFoundError(f"{folder}: no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN}")
    params = hf_to_llmc(state, cfg, str(source))
    # as load_model does an llm.c file: NaN weights only fail later
    check_finite_params(source, cfg, params)
    return cfg, params


def download_from_hub(repo_id, revision=None) -> Path:
    """The local snapshot folder of a Hub model (config.json and its weights),
    downloaded if not cached."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        raise ImportError(f"downloading {repo_id!r} from the Hugging Face Hub needs "
                          f"huggingface_hub: {INSTALL}") from None
    if not sys.stderr.isatty():
        # logs get no bar redraws (huggingface_hub's bars are tqdm's)
        disable_progress_bars()
    try:
        folder = Path(snapshot_download(repo_id, revision=revision,
                                        allow_patterns=[CONFIG_JSON, "*.safetensors",
                                                        SAFETENSORS_INDEX]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, revision=revision,
                                            allow_patterns=[CONFIG_JSON, PYTORCH_BIN]))
    except GatedRepoError:
        raise HubError(f"{repo_id}: a gated model on the Hugging Face Hub: accept its terms on "
                       "huggingface.co and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model on the Hugging Face Hub "
                       "(nor a local folder)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{repo_id}: not a local folder, and the Hugging Face Hub cannot be reached "
                       "(offline?) with no copy in the local cache: run this online once, or "
                       "give a model folder") from None
    except Exception as e:                      # HTTP errors, disk errors inside huggingface_hub
        raise HubError(f"{repo_id}: download from the Hugging Face Hub failed: "
                       f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    return folder


def is_hub_id(spec: str) -> bool:
    """Whether a -e / DIR_OR_ID that is not a local path reads as a Hub repo id (gpt2,
    openai-community/gpt2)."""
    return (bool(HUB_ID.match(spec)) and not spec.endswith((".bin", ".safetensors", ".json"))
            and ".." not in spec)


def load_hf(spec, revision=None) -> tuple:
    """(GPT2Config, params, folder) from a local GPT2LMHeadModel folder, a file inside
    one, or a Hub id."""
    path = Path(spec)
    if not path.exists():
        if not is_hub_id(spec):
            raise FileNotFoundError(f"{spec}: no such folder or file (and not a "
                                    "Hugging Face Hub id)")
        path = download_from_hub(spec, revision)
    elif path.is_file():
        model_file = (path.name in (CONFIG_JSON, SAFETENSORS_INDEX, PYTORCH_BIN)
                      or path.suffix == ".safetensors")
        # not a file of a transformers folder
        if not (model_file and (path.parent / CONFIG_JSON).is_file()):
            raise BadInput(f"{spec}: is a "
                           f"file{' (an llm.c model file)' if is_llmc_model(path) else ''}; "
                           "expected a transformers GPT-2 folder (config.json + model.safetensors) "
                           "or a Hugging Face Hub id")
        # config.json / model.safetensors / pytorch_model.bin: its folder
        path = path.parent
    cfg, params = read_hf_folder(path)
    return cfg, params, path


def is_llmc_model(path) -> bool:
    """Whether the file starts with llm.c's model magic (a quick look: the
    header is not checked)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == np.int32(MODEL_MAGIC).astype("<i4").tobytes()
    except OSError:
        return False


def tokenizer_files(cfg: GPT2Config) -> dict:
    """{name in a transformers folder: local file} of GPT-2's tokenizer (vocab.json = encoder.json,
    merges.txt = vocab.bpe) when the model has GPT-2's vocabulary and the BPE files are found
    (tokenizer.py's search); else {}."""
    if cfg.vocab_size != GPT2_VOCAB_SIZE:
        return {}
    try:
        kind, found = find_tokenizer_files()
    except TokenizerNotFoundError:
        return {}
    return {"vocab.json": found[1], "merges.txt": found[0]} if kind == "bpe" else {}


def write_hf_folder(folder, cfg: GPT2Config, params) -> list:
    """config.json + model.safetensors (fp32) for GPT2LMHeadModel.from_pretrained, and GPT-2's
    tokenizer files (vocab.json, merges.txt) for AutoTokenizer when tokenizer_files finds them;
    returns the paths written."""
    st = _safetensors()
    folder = check_folder("-o", folder)
    folder.mkdir(parents=True, exist_ok=True)
    blob = st.numpy.save(llmc_to_hf(cfg, params), metadata={"format": "pt"})
    with atomic_write(folder / SAFETENSORS) as f:
        f.write(blob)
    with atomic_write(folder / CONFIG_JSON, "w") as f:
        f.write(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    written = [folder / CONFIG_JSON, folder / SAFETENSORS]
    for name, source in tokenizer_files(cfg).items():
        with atomic_write(folder / name) as f:
            f.write(Path(source).read_bytes())
        written.append(folder / name)
    return written
