"""One training step, the only one: forward and backward over the micro-batches (gradient accumulation),
average across processes, global-norm clipping and AdamW. The trainer, the profiler, compare, the benches
and data parallel all run this function, so they cannot drift apart.

A step whose loss or gradient norm is NaN or infinite raises NonFiniteError before the update: the weights
and AdamW's moments stay as they were (the trainer then stops, or skips the step with --skip-nonfinite).
"""
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Tuple

import numpy as np

from .dist import SingleProcess
from .profiling import ranges

Batch = Tuple[np.ndarray, np.ndarray]          # (inputs, targets), each (B, T) token ids


@dataclass(frozen=True)
class AdamW:
    """AdamW and clipping settings (llm.c's defaults); the learning rate is per step, see train_step."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0        # global-norm clipping threshold; 0 = off


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; raised before the update, so the model is unchanged.

    step is train_step's 0-based index; the message counts from 1, as the trainer's step lines do.
    """

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        if not math.isfinite(loss):
            super().__init__(f"step {step + 1}: the loss is {loss}")
        else:
            super().__init__(f"step {step + 1}: the gradient norm is {grad_norm} (loss {loss:.6g})")


class StepResult(NamedTuple):
    loss: float                   # mean loss over the micro-batches (and processes)
    grad_norm: float              # global gradient norm before clipping


def train_step(model, next_batch: Callable[[], Batch], *, step: int, lr: float, accum_steps: int = 1,
               adamw: AdamW = AdamW(), dist=None) -> StepResult:
    """One optimizer step of `model` on `accum_steps` micro-batches from next_batch().

    step: 0-based index (the NVTX range is "Train step {step}", AdamW's t is step + 1).
    dist: a process group (gpt2np.dist); None = this process alone. The loss and the gradients are
    averaged over micro-batches and processes; the grad norm is the global one, before clipping.
    Raises NonFiniteError, with nothing updated, when the loss or the grad norm is not finite (every process
    sees the same averaged loss and global norm, so all of them raise together).
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    dist = dist or SingleProcess()
    with ranges.range(f"Train step {step}"):
        model.zero_grad()
        loss = 0.0
        for _ in range(accum_steps):
            x, y = next_batch()
            loss += model.forward(x, y, for_backward=True, grad_accum_steps=accum_steps) / accum_steps
            model.backward(grad_accum_steps=accum_steps)
        dist.average_grads(model)
        loss = dist.average(loss)
        norm = dist.grad_norm(model)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise NonFiniteError(step, float(loss), float(norm))
        model.update(lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay, step + 1, adamw.grad_clip,
                     grad_norm=norm, shard=dist.shard(model.num_parameters))
        dist.gather_params(model)
        model.backend.synchronize()
    return StepResult(float(loss), float(norm))
