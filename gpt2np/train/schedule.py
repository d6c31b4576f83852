"""Learning-rate schedules as llm.c's (llmc/schedulers.h): the lr of 0-based `step` of total_steps.

    cosine    warmup lr*(step+1)/warmup, then a cosine from lr down to lr*final_frac at step
              total_steps (after the last step trained, as llm.c's)
    linear    the same warmup, then a straight line down to lr*final_frac (at step total_steps)
    constant  lr at every step: llm.c's constant schedule has no warmup (-u changes nothing)
    wsd       warmup, stable at lr, then over the last 20% of the steps a 1 - sqrt cooldown to
              lr*final_frac (Hägele et al. 2024, arXiv:2405.18392; llm.c's decay point
              (int)(0.8f * total_steps), in float32)

A step past the end (a finished run extended with a larger -x) keeps the last decay value.
"""
import math

import numpy as np

SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAY_START = 0.8          # llm.c's: the fraction of the steps before the wsd cooldown


def learning_rate(step, max_lr, total_steps, warmup=0, final_frac=1.0, kind="cosine"):
    """lr at 0-based `step` of `total_steps` for schedule `kind` (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    if kind == "constant":
        return max_lr
    if step < warmup:
        return max_lr * (step + 1) / warmup
    min_lr = max_lr * final_frac
    if kind == "wsd":
        # llm.c's (int)(0.8f * N)
        decay_start = int(np.float32(WSD_DECAY_START) * np.float32(total_steps))
        if step < decay_start:
            return max_lr
        cooldown = _fraction(step - decay_start, total_steps - decay_start)
        return min_lr + (1.0 - math.sqrt(cooldown)) * (max_lr - min_lr)
    ratio = _fraction(step - warmup, total_steps - warmup)
    if kind == "linear":
        return max_lr - ratio * (max_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def _fraction(done, length):
    """done / length clamped to [0, 1] (a zero-length decay is already done)."""
    return min(max(done / length, 0.0), 1.0) if length > 0 else 1.0
