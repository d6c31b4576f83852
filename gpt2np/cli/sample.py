"""`gpt2np sample`: text from a GPT-2 model (gpt2np.generate: temperature, top-k, the KV cache).

    gpt2np sample -e model.bin --prompt "To be or" -g 64 --temperature 0.8 --top-k 40
    gpt2np sample -e log/model_00000020.bin --seed 1337 -g 63   # train's sample at step 20 (-g 64)

The coins are llm.c's (gpt2np.rng.LlmcCoins, the xorshift of llmc/sampler.h), as train's samples
use them: from train's --seed, --temperature and --top-k, train's prompt (<|endoftext|>, no
--prompt) and one token fewer than train's -g, a checkpoint's sample is the one the run printed at
that step.
"""
import codecs
import sys
import time

from gpt2np.backends import inference_backend
from gpt2np.cli.eval import MODEL_HELP, backend_words, check_cpu_math
from gpt2np.datasets.starter import load_any_model
from gpt2np.errors import ArgumentParser, BadInput, integer, number, tool
from gpt2np.formats.tokenizer import get_encoding
from gpt2np.generate import generate
from gpt2np.model import GPT2
from gpt2np.rng import LlmcCoins


# ---- gpt2np sample -------------------------------------------------------------------------------
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
    p = ArgumentParser(prog="gpt2np sample",
                       description="Generate text from a GPT-2 model: tokenize the prompt, sample "
                       "-g tokens (KV cache: each new token costs one position), print them.")
    p.add_argument("-e", "--model", required=True, help=MODEL_HELP)
    p.add_argument("--prompt", default="",
                   help="text to continue (default: start from <|endoftext|>)")
    p.add_argument("-g", "--gen-tokens", type=int, default=64,
                   help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature, 0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens, 0 = all (default 0)")
    p.add_argument("--seed", type=int, default=1337,
                   help="state of llm.c's sampling coins (xorshift), as train's --seed sets "
                        "them for its samples (default 1337): train --seed S -g G prints at a "
                        "checkpoint what sample -e CHECKPOINT --seed S -g G-1 prints (llm.c's -g "
                        "counts the <|endoftext|> it starts from)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="independent samples of the prompt (default 1)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "numpy", "cuda", "emu"),
                   help="auto = cuda if there is a GPU, else cpu; emu = the CUDA kernels on the "
                        "CPU emulator (default auto); training's precision and attention "
                        "defaults for the device")
    p.add_argument("--no-cache", action="store_true",
                   help="run the full forward pass for every new token instead of the KV cache")
    p.add_argument("--cpu-math", choices=("fast", "exact"),
                   help="with --no-cache on the CPU: the numpy backend's math for the full "
                        "forward, as train.py's --cpu-math (default fast); the KV cache's own "
                        "decoding is plain NumPy either way")
    p.add_argument("--bpe-dir",
                   help="folder with gpt2_vocab.bpe + gpt2_encoder.json, or a gpt2_tokenizer.bin")
    args = p.parse_args(argv)
    integer(0).check("-g", args.gen_tokens, "the tokens to generate")
    number(0, words="a finite number >= 0 (0 = greedy)").check("--temperature", args.temperature,
                                                               "the sampling temperature")
    integer(0, words="an integer >= 0 (0 = all)").check("--top-k", args.top_k, "the top-k")
    integer(0).check("--seed", args.seed, "the seed")
    integer(1).check("--num-samples", args.num_samples, "the number of samples")
    check_cpu_math(args)
    if args.cpu_math and not args.no_cache:
        raise BadInput(f"--cpu-math {args.cpu_math}: only with --no-cache (the KV cache decodes in "
                       "plain NumPy, whose math the flag does not choose)")
    encoding = get_encoding(args.bpe_dir)
    cfg, params, desc = load_any_model(args.model)
    prompt = encoding.encode_ordinary(args.prompt) if args.prompt else [encoding.eot_token]
    # no --prompt to blame: the default start is missing
    if max(prompt) >= cfg.vocab_size and not args.prompt:
        raise BadInput(f"the model's vocabulary of {cfg.vocab_size} has no <|endoftext|> (token "
                       f"{prompt[0]}) to start "
                       f"from without a prompt: give --prompt with tokens within it")
    if max(prompt) >= cfg.vocab_size:
        raise BadInput(f"--prompt: token {max(prompt)} is outside the model's vocabulary of "
                       f"{cfg.vocab_size} (a model trained with another tokenizer?)")
    backend, attention = inference_backend(args.device, cfg.channels // cfg.num_heads,
                                           args.cpu_math)
    # the KV cache decodes in NumPy on the host; a backend with kernels runs the full forward pass
    cache = not args.no_cache and not backend.launches_kernels
    model = GPT2(cfg, backend, 1, 1 if cache else cfg.max_seq_len,
                 attention="naive" if cache else attention)
    model.load_params(params)
    coins = LlmcCoins(args.seed)                # one stream for all the samples: each continues it
    print(f"model {desc}: {cfg.num_layers} layers, {cfg.channels} channels, "
          f"{model.num_parameters:,} parameters on {'numpy' if cache else backend_words(backend)}; "
          f"{'KV cache (plain NumPy)' if cache else 'full forward per token'}", file=sys.stderr)
    for s in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {s + 1} of {args.num_samples} ---", flush=True)
        stream = TextStream(encoding)
        if args.prompt:
            sys.stdout.write(args.prompt)
        started = time.perf_counter()
        generate(model, prompt, args.gen_tokens, coins, args.temperature, args.top_k, cache=cache,
                 on_token=stream)
        seconds = time.perf_counter() - started
        stream.end()
        print(f"{len(prompt)} prompt + {args.gen_tokens} new tokens in {seconds:.2f} s "
              f"({args.gen_tokens / max(seconds, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
