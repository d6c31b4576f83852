"""The lr schedules against llm.c's (llmc/schedulers.h), computed here independently: every step of
a grid of run lengths, warmups and final fractions, in llm.c's float32 arithmetic with NumPy, whole
schedules at once."""
import numpy as np
import pytest

from gpt2np.train.schedule import SCHEDULES, learning_rate

LR = np.float32(6e-4)


def llmc_schedule(kind, total, warmup, final_frac):
    """llm.c's lr for steps 0..total-1, float32 as its C code computes it."""
    f32 = np.float32
    step = np.arange(total, dtype=np.int64)
    min_lr = LR * f32(final_frac)
    warm = LR * (step + 1).astype(f32) / f32(max(warmup, 1))
    if kind == "constant":                                  # no warmup at all
        return np.full(total, LR)
    if kind == "wsd":
        decay_point = int(f32(0.8) * f32(total))
        ratio = (step - decay_point).astype(f32) / f32(total - decay_point)
        cooldown = min_lr + (f32(1) - np.sqrt(np.clip(ratio, 0, 1))) * (LR - min_lr)
        return np.where(step < warmup, warm, np.where(step < decay_point, LR, cooldown))
    ratio = (step - warmup).astype(f32) / f32(max(total - warmup, 1))
    if kind == "linear":
        decayed = LR - ratio * (LR - min_lr)
    else:
        decayed = min_lr + f32(0.5) * (f32(1) + np.cos(f32(np.pi) * ratio)) * (LR - min_lr)
    return np.where(step < warmup, warm, decayed)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("total", [1, 2, 5, 10, 37, 100])
@pytest.mark.parametrize("warmup", [0, 1, 3, 10])
@pytest.mark.parametrize("final_frac", [0.0, 0.1, 1.0])
def test_schedule_is_llmc_at_every_step(kind, total, warmup, final_frac):
    ours = [learning_rate(s, float(LR), total, warmup, final_frac, kind) for s in range(total)]
    # atol: a few float32 ulps of lr, where llm.c's float32 decay nears 0
    np.testing.assert_allclose(ours, llmc_schedule(kind, total, warmup, final_frac), rtol=2e-6,
                               atol=1e-10)


def test_hand_computed_points():
    # constant ignores -u; wsd's last 20% follow 1 - sqrt(ratio); cosine and linear reach
    # lr*final_frac at the end
    assert learning_rate(0, 6e-4, 10, warmup=3, kind="constant") == 6e-4
    assert (learning_rate(9, 3e-4, 10, final_frac=0.0, kind="wsd")
            == pytest.approx(3e-4 * (1 - 0.5 ** 0.5)))
    # decay point int(0.8 * 10) = 8
    assert learning_rate(7, 3e-4, 10, final_frac=0.0, kind="wsd") == 3e-4
    # ratio 0 at the decay point
    assert learning_rate(8, 3e-4, 10, final_frac=0.0, kind="wsd") == 3e-4
    assert learning_rate(0, 6e-4, 5, warmup=2, final_frac=0.1) == pytest.approx(3e-4)
    cosine = 6e-5 + 0.5 * (1 + np.cos(np.pi * 0.75)) * 5.4e-4              # ratio (5 - 2) / (6 - 2)
    assert learning_rate(5, 6e-4, 6, warmup=2, final_frac=0.1) == pytest.approx(cosine)
    assert (learning_rate(5, 6e-4, 6, warmup=2, final_frac=0.1, kind="linear")
            == pytest.approx(6e-4 - 0.75 * 5.4e-4))


def test_past_the_end_keeps_the_last_decay_value():
    assert learning_rate(50, 6e-4, 10, final_frac=0.1) == pytest.approx(6e-5)
    assert learning_rate(50, 6e-4, 10, final_frac=0.1, kind="wsd") == pytest.approx(6e-5)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        learning_rate(0, 1e-3, 10, kind="step")


def test_wsd_decay_point_is_llmcs_float32():
    # N = 5,242,881: llm.c's (int)(0.8f * N) is 4,194,305 in float32 (double: 4,194,304), so step
    # 4,194,305 is the decay point itself, still at the full lr
    assert learning_rate(4_194_305, 1.0, 5_242_881, final_frac=0.0, kind="wsd") == 1.0
