"""Learning-rate schedules as llm.c defines them: linear warmup, then cosine, linear, constant or wsd."""
import math

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def learning_rate(step, max_lr, total_steps, warmup=0, final_frac=1.0, kind="cosine", cooldown_frac=0.2):
    """lr at 0-based `step` of `total_steps`: warmup (lr*(step+1)/warmup), then decay to max_lr*final_frac."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}: expected one of {', '.join(SCHEDULES)}")
    min_lr = max_lr * final_frac
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if kind == "constant":
        return max_lr
    if kind == "wsd":                     # warmup, stable, then a linear cooldown over the last fraction
        cooldown_start = int(total_steps * (1.0 - cooldown_frac))
        if step < cooldown_start:
            return max_lr
        ratio = (step - cooldown_start) / max(1, total_steps - cooldown_start)
        return max_lr + (min_lr - max_lr) * min(ratio, 1.0)
    ratio = (step - warmup) / max(1, total_steps - warmup)
    ratio = min(max(ratio, 0.0), 1.0)
    if kind == "linear":
        return max_lr + (min_lr - max_lr) * ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)
