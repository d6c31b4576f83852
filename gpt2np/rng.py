"""llm.c's random number generators: mt19937 (llmc/rand.h: init and the data shuffle) and the
xorshift64* coins of its sampler (llmc/sampler.h)."""
import numpy as np

MASK64 = (1 << 64) - 1
LLMC_SAMPLE_STATE = 1337


class LlmcCoins:
    """llm.c's sampling coins (llmc/sampler.h): random_f32 of a xorshift64* state, a float in [0, 1)
    with 24 bits. llm.c's trainer starts every sample from the state 1337 (gpt2np's: --seed, 1337 by
    default; a state of 0, which xorshift keeps at 0 for ever, takes llm.c's 1337)."""

    def __init__(self, state: int):
        self.state = state & MASK64 or LLMC_SAMPLE_STATE

    def random(self) -> float:
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK64
        s ^= s >> 27
        self.state = s
        return ((((s * 0x2545F4914F6CDD1D) & MASK64) >> 32) >> 8) / 16777216.0


def llmc_generator(seed: int) -> np.random.MT19937:
    """llm.c's mt19937 (llmc/rand.h, PyTorch's) after manual_seed(seed): NumPy's MT19937 in the
    state that its legacy integer seeding (the reference generator's init_genrand) leaves, so
    random_raw() gives randint32()'s sequence."""
    _, key, pos, *_ = np.random.RandomState(seed).get_state()
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    return generator
