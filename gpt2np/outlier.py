"""llm.c's outlier guard (train.py -sl Z / -sg Z; llm.c's llmc/outlier_detector.h): skip the AdamW
update of a step whose loss (or gradient norm) lies more than Z standard deviations above the mean
of a window of recent steps.

llm.c: every step pushes its loss and its grad norm into 128-value ring buffers and takes the
z-score of the new value over its buffer *including* the new value (population std; NaN while fewer
than 128 values came before it, 0 when the std is 0); the update is skipped when the loss's z > Z_l
(checked first, -sl) or the norm's z > Z_g (-sg). Every value goes in, a skipped step's too; the
step counter, the lr schedule and AdamW's t go on as if the step had been applied (the skipped
step's t is not reused). llm.c prints both z-scores on every step line, -sl/-sg or not, and so does
the trainer (the window is kept, and checkpointed, in every run).

Here the decision is one step late (the step line still prints llm.c's z-scores: zscores(lag=1)).
The CUDA step runs without a host sync: the host reads each step's loss and norm back while
the next step runs (gpt2np.train_step.PendingStep), so when it launches step s it knows the values
of steps <= s - 2 only. Both backends therefore score step s against the same window: the WINDOW - 1
= 127 most recent finite values of steps <= s - 2, plus step s's own value (the window llm.c scores
against, less step s - 1 and plus the step before the 127). Same history, same decisions on NumPy
and on CUDA; the first step that can be skipped is step 128 (0-based), as in llm.c. A non-finite
step's values stay out (llm.c's running sums would turn NaN for good; --skip-nonfinite
handles those steps).

The device compares, the host decides the threshold. A z-score over a window that includes the value
is increasing in the value: with m, sd the mean and population std of the n - 1 others (n = WINDOW),
z = d sqrt(n - 1) / sqrt(n sd^2 + d^2), d = value - m, so z > Z exactly when d > Z sd sqrt(n / (n -
1 - Z^2)) (never when Z^2 >= n - 1: z <= sqrt(n - 1) always, so llm.c never skips then either). The
host turns the window into two limits before the step (rounded up to float32, so a value above the
limit has z > Z); the NumPy step compares its loss and norm with them on the host, the CUDA AdamW
kernel reads them from step_scalars (model.set_step_scalars) and compares on the device (loss as
float32, norm in double, as the host reads both back), and the trainer repeats those comparisons on
the values it reads back to report the skip (exceeded).

Under mpiexec every rank sees the same averaged loss and global norm (gpt2np.dist), so every rank's
guard holds the same window and takes the same decision, with no extra communication.
"""
import math
from collections import deque
from typing import NamedTuple

import numpy as np

# llm.c's OUTLIER_DETECTOR_WINDOW_SIZE: the scored value and the WINDOW - 1 before it
WINDOW = 128
# step s is scored against steps <= s - LAG (the CUDA step learns s - 1's values too late)
LAG = 2


class Limits(NamedTuple):
    """A step's skip thresholds: skip when loss > loss or grad norm > norm (float32
    values; inf = no limit)."""
    loss: float = math.inf
    norm: float = math.inf


NO_LIMITS = Limits()


def exceeded(loss: float, norm: float, limits: Limits):
    """'loss', 'norm' (the loss first, as llm.c) or None: what the update is skipped for. The
    comparisons the device makes (adamw_update_device): the loss and limits are float32 values, the
    norm the double the host reads back."""
    if loss > limits.loss:
        return "loss"
    if norm > limits.norm:
        return "norm"
    return None


def value_limit(others, z: float) -> float:
    """The smallest float32 L such that any value > L has a z-score > z over `others` (n - 1 values)
    plus itself, as llm.c computes it; inf when z <= 0 (off) or no value can reach
    z (z^2 >= n - 1)."""
    others = np.asarray(others, np.float64)
    n = others.size + 1
    if z <= 0 or others.size == 0 or z * z >= n - 1:
        return math.inf
    lo, hi = float(others.min()), float(others.max())
    # sd = 0: any larger value has z = sqrt(n - 1) > z; an equal one z = 0
    if lo == hi:
        limit = hi
    else:
        mean = float(others.mean())
        sd = math.sqrt(float(np.mean((others - mean) ** 2)))
        limit = mean + z * sd * math.sqrt(n / (n - 1 - z * z))
    limit32 = np.float32(limit)
    # round up: "> limit32" never skips a value whose z is <= z
    if float(limit32) < limit:
        limit32 = np.nextafter(limit32, np.float32(np.inf))
    return float(limit32)


def zscore(others, value: float) -> float:
    """llm.c's z-score of `value` over the window others (n - 1 values) + [value]: population std, 0
    when the std is 0."""
    window = np.append(np.asarray(others, np.float64), float(value))
    mean = float(window.mean())
    sd = math.sqrt(float(np.mean((window - mean) ** 2)))
    return 0.0 if sd == 0.0 else (float(value) - mean) / sd


class OutlierGuard:
    """The window of recent (step, loss, grad norm) and the limits it sets; see
    the module docstring.

    loss_z, grad_z: -sl, -sg (0 = off); window: WINDOW by default. observe() each step's values in
    step order (the trainer does when it reads them); limits(s) before launching step s; zscores(s,
    ...) to report it."""

    def __init__(self, loss_z: float = 0.0, grad_z: float = 0.0, window: int | None = None):
        window = WINDOW if window is None else window        # (read here: tests shrink WINDOW)
        if window < 2:
            raise ValueError(f"the outlier window must hold at least 2 values, got {window}")
        self.loss_z, self.grad_z, self.window = float(loss_z), float(grad_z), int(window)
        # (step, loss, norm): enough for any step's window
        self.history = deque(maxlen=self.window)
        # updates skipped as outliers (the trainer counts)
        self.skipped = 0

    @property
    def active(self) -> bool:
        return self.loss_z > 0 or self.grad_z > 0

    def observe(self, step: int, loss: float, norm: float):
        """Add step's loss and grad norm (ignored when either is not finite)."""
        if math.isfinite(loss) and math.isfinite(norm):
            if self.history and step <= self.history[-1][0]:
                raise ValueError(f"outlier window: step {step} observed after step "
                                 f"{self.history[-1][0]}")
            self.history.append((int(step), float(loss), float(norm)))

    def _others(self, step, lag=LAG):
        """(losses, norms) float64 (window - 1,) of the latest steps <= step - lag, or None while
        too few: llm.c's detector scores a value once `window` values came before it (lag 1, its own
        numbers); one step later (lag 2, the decision's window) the window - 1 then known, so that
        the first step scored is the same."""
        rows = [r for r in self.history if r[0] <= step - lag]
        if len(rows) < self.window - (lag - 1):
            return None
        arr = np.array(rows[-(self.window - 1):], np.float64)
        return arr[:, 1], arr[:, 2]

    def limits(self, step: int) -> Limits:
        """Step's skip thresholds (NO_LIMITS while the window fills or with both limits off)."""
        others = self._others(step) if self.active else None
        if others is None:
            return NO_LIMITS
        return Limits(value_limit(others[0], self.loss_z), value_limit(others[1], self.grad_z))

    def zscores(self, step: int, loss: float, norm: float, lag: int = LAG):
        """(loss z, norm z) of step's values over its window: lag 1, llm.c's numbers (the steps just
        before it, as the step line prints them); lag 2, the decision's (limits()); NaN while
        the window fills."""
        others = self._others(step, lag)
        if others is None:
            return math.nan, math.nan
        return zscore(others[0], loss), zscore(others[1], norm)

    # ---- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-able: the window and the count (resuming with it makes the same decisions
        as not stopping)."""
        return {"window": [list(r) for r in self.history], "skipped": self.skipped}

    def load_state(self, state: dict):
        self.history.clear()
        for step, loss, norm in state.get("window", []):
            self.observe(int(step), float(loss), float(norm))
        self.skipped = int(state.get("skipped", 0))
