"""GPT-2 model configuration and llm.c's depth presets (d12, d24, d36, d48)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class GPT2Config:
    """Hyperparameters of the network, named as in llm.c's GPT2Config.

    max_seq_len (maxT): positions in wpe.  vocab_size (V): real tokens.
    padded_vocab_size (Vp): V rounded up to a multiple of 128 (wte rows).
    """
    max_seq_len: int = 1024
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    num_layers: int = 12
    num_heads: int = 12
    channels: int = 768

    def __post_init__(self):
        checks = [
            (self.max_seq_len > 0, "max_seq_len must be positive"),
            (self.vocab_size > 0, "vocab_size must be positive"),
            (self.padded_vocab_size >= self.vocab_size, "padded_vocab_size must be >= vocab_size"),
            (self.num_layers > 0, "num_layers must be positive"),
            (self.num_heads > 0, "num_heads must be positive"),
            (self.channels > 0 and self.channels % self.num_heads == 0,
             "channels must be a positive multiple of num_heads"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"GPT2Config: {msg} (got {self})")

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    def describe(self) -> str:
        return (f"max_seq_len: {self.max_seq_len}\nvocab_size: {self.vocab_size}\n"
                f"padded_vocab_size: {self.padded_vocab_size}\nnum_layers: {self.num_layers}\n"
                f"num_heads: {self.num_heads}\nchannels: {self.channels}")


def pad_vocab(vocab_size: int, multiple: int = 128) -> int:
    """Vp: the vocabulary rounded up to a multiple (llm.c pads 50257 to 50304)."""
    return (vocab_size + multiple - 1) // multiple * multiple


# llm.c's presets: depth -> (num_layers, num_heads, channels)
PRESETS = {
    "d12": (12, 12, 768),
    "d24": (24, 16, 1024),
    "d36": (36, 20, 1280),
    "d48": (48, 25, 1600),
}


def preset(name: str, max_seq_len: int = 1024, vocab_size: int = 50257) -> GPT2Config:
    """The config for a depth preset such as 'd12' (GPT-2 124M when V=50257)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}")
    L, NH, C = PRESETS[name]
    return GPT2Config(max_seq_len, vocab_size, pad_vocab(vocab_size), L, NH, C)
