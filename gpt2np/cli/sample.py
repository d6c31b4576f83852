"""Autoregressive sampling from a GPT2 model: temperature and top-k over the real vocabulary, and `gpt2np sample`.

    gpt2np sample -e model.bin --prompt "To be or" -g 64 --temperature 0.8 --top-k 40

generate() runs the full forward pass over the last T tokens for every new token (the trainer's samples), or,
with cache=True, a cache of keys and values (KVCache): the prompt goes through the layers once, then each new
token costs one position: its q, k, v, attention over the cached keys and values, and the MLP of that one row.
"""
import codecs
import math
import sys
import time

import numpy as np

from gpt2np import ranges
from gpt2np.errors import ArgumentParser, BadInput, integer, number, tool
from gpt2np.tensors import views

LN_EPS = 1e-5
GELU_SCALE = math.sqrt(2.0 / math.pi)


MASK64 = (1 << 64) - 1
LLMC_SAMPLE_STATE = 1337


class LlmcCoins:
    """llm.c's sampling coins (llmc/sampler.h): random_f32 of a xorshift64* state, a float in [0, 1) with 24 bits.
    llm.c's trainer starts every sample from the state 1337 (gpt2np's: --seed, 1337 by default; a state of 0, which
    xorshift keeps at 0 for ever, takes llm.c's 1337)."""

    def __init__(self, state: int):
        self.state = state & MASK64 or LLMC_SAMPLE_STATE

    def random(self) -> float:
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK64
        s ^= s >> 27
        self.state = s
        return ((((s * 0x2545F4914F6CDD1D) & MASK64) >> 32) >> 8) / 16777216.0


def sample_next(logits, rng, temperature=1.0, top_k=0):
    """One token id from a (V,) row of logits. temperature 0 = greedy; top_k 0 = the whole vocabulary.
    rng: anything with random() in [0, 1) (a NumPy Generator, LlmcCoins): one coin a token, and the first id whose
    cumulative probability exceeds it, llm.c's sample_softmax rule (and NumPy's Generator.choice's)."""
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.size:
        cut = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cut, logits, -np.inf)
    cdf = np.cumsum(np.exp(logits - logits.max()))
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)


# ---- decoding with a cache of keys and values ----------------------------------------------------------------
def _layernorm(x, weight, bias):
    xc = x - x.mean(axis=-1, keepdims=True)
    rstd = (1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + np.float32(LN_EPS))).astype(np.float32)
    return xc * rstd * weight + bias


def _linear(x, weight, bias=None):
    """x (n, C) @ weight (OC, C)^T (+ bias): for one row as weight @ x, BLAS's matrix-vector product."""
    y = (weight @ x[0])[None] if x.shape[0] == 1 else x @ weight.T
    return y if bias is None else y + bias


def _gelu(x):
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(np.float32(GELU_SCALE) * (x + np.float32(0.044715)
                                                                                      * x * x * x)))


class KVCache:
    """The keys and values of every position decoded so far, per layer and head, on the host: (L, NH, maxT, HS).

    decode(tokens) appends tokens at positions length, length+1, ... and returns their logits; each runs through
    the layers alone, attending to the cached keys and values, so a new token costs one position, not the whole
    sequence. The math is the model's forward pass (the numpy backend's ops) in NumPy on the model's own
    parameters (shared on the numpy backend, a host copy on others), tested against the full forward.
    """

    def __init__(self, model, capacity=None):
        cfg = model.cfg
        self.cfg = cfg
        self.capacity = int(capacity or cfg.max_seq_len)
        if not 0 < self.capacity <= cfg.max_seq_len:
            raise ValueError(f"KV cache capacity {self.capacity} must be in 1..{cfg.max_seq_len}")
        params = model.params if isinstance(model.params, np.ndarray) else model.backend.to_host(model.params)
        self.p = views(params, model.param_shapes)
        L, NH, HS = cfg.num_layers, cfg.num_heads, cfg.head_size
        self.k = np.zeros((L, NH, self.capacity, HS), np.float32)
        self.v = np.zeros((L, NH, self.capacity, HS), np.float32)
        self.length = 0

    def reset(self):
        """Forget every position (the next decode starts at position 0)."""
        self.length = 0

    def decode(self, tokens, all_logits=False):
        """Logits of the real vocabulary for new tokens at the next positions: (n, V) with all_logits, else the
        last token's (V,). The cache grows by n; more than its capacity is a ValueError."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        cfg, p = self.cfg, self.p
        n, t0 = tokens.size, self.length
        if n == 0:
            raise ValueError("decode needs at least one token")
        if t0 + n > self.capacity:
            raise ValueError(f"KV cache full: {t0} positions + {n} new > capacity {self.capacity}")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            bad = int(tokens.max() if tokens.max() >= cfg.vocab_size else tokens.min())
            raise ValueError(f"token id {bad} outside [0, {cfg.vocab_size})")
        NH, HS, C = cfg.num_heads, cfg.head_size, cfg.channels
        t1 = t0 + n
        scale = np.float32(1.0 / math.sqrt(HS))
        # query i (position t0+i) sees keys 0..t0+i: -inf above that diagonal
        future = np.arange(t1)[None, :] > (t0 + np.arange(n))[:, None]
        x = p["wte"][tokens] + p["wpe"][t0:t1]                                    # (n, C)
        with ranges.range("decode"):
            for l in range(cfg.num_layers):
                h = _layernorm(x, p["ln1w"][l], p["ln1b"][l])
                qkv = _linear(h, p["qkvw"][l], p["qkvb"][l])                         # (n, 3C)
                q, k, v = qkv.reshape(n, 3, NH, HS).transpose(1, 2, 0, 3)         # each (NH, n, HS)
                self.k[l, :, t0:t1] = k
                self.v[l, :, t0:t1] = v
                att = (q @ self.k[l, :, :t1].transpose(0, 2, 1)) * scale          # (NH, n, t1)
                att[:, future] = -np.inf
                att -= att.max(axis=-1, keepdims=True)
                np.exp(att, out=att)
                att /= att.sum(axis=-1, keepdims=True)
                y = (att @ self.v[l, :, :t1]).transpose(1, 0, 2).reshape(n, C)    # heads concatenated
                x = x + _linear(y, p["attprojw"][l], p["attprojb"][l])
                h = _layernorm(x, p["ln2w"][l], p["ln2b"][l])
                f = _gelu(_linear(h, p["fcw"][l], p["fcb"][l]))
                x = x + _linear(f, p["fcprojw"][l], p["fcprojb"][l])
            self.length = t1
            last = x if all_logits else x[-1:]
            logits = _linear(_layernorm(last, p["lnfw"], p["lnfb"]), p["wte"][:cfg.vocab_size])
        return logits if all_logits else logits[0]


def generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0, *, cache=False, on_token=None):
    """prompt: list of token ids -> prompt + max_new_tokens sampled ids; on_token(id) is called for each new one.

    cache=False: each step runs the model's forward pass on batch row 0 over the last T tokens (model.T).
    cache=True: a KVCache of the model's max_seq_len positions; when it is full, it restarts from the last half
    of the tokens (the context then holds max_seq_len/2 .. max_seq_len tokens).
    """
    tokens = list(prompt)
    if max_new_tokens <= 0:
        return tokens
    V, T = model.cfg.vocab_size, model.T
    with ranges.range("generation"):
        if cache:
            kv = KVCache(model)
            keep = max(kv.capacity // 2, 1)
            logits = kv.decode(tokens[-kv.capacity:])
        for i in range(max_new_tokens):
            if not cache:
                window = np.asarray(tokens[-T:], np.int32)[None, :]
                model.forward(window)
                logits = model.backend.to_host(model.act["logits"][0, window.shape[1] - 1, :V])
            tokens.append(sample_next(logits, rng, temperature, top_k))
            if on_token is not None:
                on_token(tokens[-1])
            if cache and i + 1 < max_new_tokens:
                if kv.length < kv.capacity:
                    logits = kv.decode(tokens[-1:])
                else:
                    kv.reset()
                    logits = kv.decode(tokens[-keep:])
    return tokens


# ---- gpt2np sample -------------------------------------------------------------------------------------------
class TextStream:
    """Prints tokens as they come; a character split across tokens is printed once it is whole."""

    def __init__(self, encoding, out=None):
        self.encoding, self.out = encoding, out or sys.stdout
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token):
        self.out.write(self.utf8.decode(self.encoding.decode_single_token_bytes(int(token))))
        self.out.flush()

    def end(self):
        self.out.write(self.utf8.decode(b"", final=True) + "\n")
        self.out.flush()


@tool
def main(argv=None):
    """Sample from a model; bad flags, a missing model or tokenizer: one line, exit 2."""
    p = ArgumentParser(prog="python -m gpt2np.cli.sample", description="Generate text from a GPT-2 model: tokenize "
                       "the prompt, sample -g tokens (KV cache: each new token costs one position), print them.")
    p.add_argument("-e", "--model", required=True,
                   help="llm.c model file, transformers GPT-2 folder, or a Hugging Face Hub id (gpt2, gpt2-medium)")
    p.add_argument("--prompt", default="", help="text to continue (default: start from <|endoftext|>)")
    p.add_argument("-g", "--gen-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, 0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens, 0 = all (default 0)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (default 1337)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples of the prompt (default 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "numpy", "cuda", "emu"),
                   help="auto = cuda if there is a GPU, else cpu; emu = the CUDA kernels on the CPU emulator (default "
                        "auto); training's precision and attention defaults for the device")
    p.add_argument("--no-cache", action="store_true",
                   help="run the full forward pass for every new token instead of the KV cache")
    p.add_argument("--cpu-math", choices=("fast", "exact"),
                   help="with --no-cache on the CPU: the numpy backend's math for the full forward, as train.py's "
                        "--cpu-math (default fast); the KV cache's own decoding is plain NumPy either way")
    p.add_argument("--bpe-dir", help="folder with gpt2_vocab.bpe + gpt2_encoder.json, or a gpt2_tokenizer.bin")
    args = p.parse_args(argv)
    integer(0).check("-g", args.gen_tokens, "the tokens to generate")
    number(0, words="a finite number >= 0 (0 = greedy)").check("--temperature", args.temperature,
                                                               "the sampling temperature")
    integer(0, words="an integer >= 0 (0 = all)").check("--top-k", args.top_k, "the top-k")
    integer(0).check("--seed", args.seed, "the seed")
    integer(1).check("--num-samples", args.num_samples, "the number of samples")

    from gpt2np.backends import inference_backend
    from gpt2np.cli.eval import backend_words, check_cpu_math
    from gpt2np.formats.hf import load_any_model
    from gpt2np.formats.tokenizer import get_encoding
    from gpt2np.model import GPT2
    check_cpu_math(args)
    if args.cpu_math and not args.no_cache:
        raise BadInput(f"--cpu-math {args.cpu_math}: only with --no-cache (the KV cache decodes in plain NumPy, "
                       f"whose math the flag does not choose)")
    encoding = get_encoding(args.bpe_dir)
    cfg, params, desc = load_any_model(args.model)
    prompt = encoding.encode_ordinary(args.prompt) if args.prompt else [encoding.eot_token]
    if max(prompt) >= cfg.vocab_size and not args.prompt:      # no --prompt to blame: the default start is missing
        raise BadInput(f"the model's vocabulary of {cfg.vocab_size} has no <|endoftext|> (token {prompt[0]}) to start "
                       f"from without a prompt: give --prompt with tokens within it")
    if max(prompt) >= cfg.vocab_size:
        raise BadInput(f"--prompt: token {max(prompt)} is outside the model's vocabulary of {cfg.vocab_size} "
                       f"(a model trained with another tokenizer?)")
    backend, attention = inference_backend(args.device, cfg.channels // cfg.num_heads, args.cpu_math)
    cache = not args.no_cache and backend.name == "numpy"     # elsewhere the full forward pass (on the GPU)
    model = GPT2(cfg, backend, 1, 1 if cache else cfg.max_seq_len, attention="naive" if cache else attention)
    model.load_params(params)
    rng = np.random.default_rng(args.seed)
    print(f"model {desc}: {cfg.num_layers} layers, {cfg.channels} channels, {model.num_parameters:,} parameters "
          f"on {'numpy' if cache else backend_words(backend)}; "
          f"{'KV cache (plain NumPy)' if cache else 'full forward per token'}", file=sys.stderr)
    for s in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {s + 1} of {args.num_samples} ---", flush=True)
        stream = TextStream(encoding)
        if args.prompt:
            sys.stdout.write(args.prompt)
        started = time.perf_counter()
        generate(model, prompt, args.gen_tokens, rng, args.temperature, args.top_k, cache=cache, on_token=stream)
        seconds = time.perf_counter() - started
        stream.end()
        print(f"{len(prompt)} prompt + {args.gen_tokens} new tokens in {seconds:.2f} s "
              f"({args.gen_tokens / max(seconds, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
