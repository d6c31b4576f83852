"""One training step, the only one: forward and backward over the micro-batches (gradient
accumulation), average across processes, global-norm clipping and AdamW. The trainer, the profiler,
compare, the benches and data parallel all run this function, so they cannot drift apart.

A step whose loss or gradient norm is NaN or infinite changes nothing (the weights and AdamW's
moments stay as they were) and raises NonFiniteError, naming the step (the trainer then stops, or
skips the step with --skip-nonfinite). A step given outlier `limits` (gpt2np.outlier, -sl/-sg) whose
loss or norm is above them changes nothing either, and returns its result as usual: the caller, who
set the limits, tells (outlier.exceeded).

Two ways to run it, the same math:
  * the host step (the NumPy backend): the loss and the norm are host floats, checked (and compared
    with the limits) before the update; train_step returns a StepResult and raises
    NonFiniteError itself.
  * the device step (backends with upload_tokens, i.e. CUDA): the host never waits for the device
    inside the step. The micro-batches' tokens go up first (with encoder_backward's token grouping,
    made from the host copy), and the step's AdamW scalars (lr, bias corrections) into a small
    device buffer; the mean loss and the squared grad norm are reduced on the device into
    model.stats; AdamW reads them there, clips by them and skips the whole update when either is not
    finite or above its limit (uploaded with the scalars). train_step returns a PendingStep: its
    loss and grad_norm arrive by an asynchronous copy and are resolved when read (raising
    NonFiniteError then), so the trainer prints step N while step N+1 runs. With cuda_graphs, the
    device work of a step is captured once per shape as a CUDA graph (after one eager step, which
    makes every lazily allocated buffer) and replayed afterwards: one launch per step instead of
    hundreds (under MPI, three: the collectives run between them, see _device_segments).

Either way each micro-batch's forward and backward are told whether they start the step: the first
overwrites the gradients (and the device loss), the others add to them. So no zero_grad() pass is
needed, and the model keeps no record of where a step stands: a graph's replay, which runs none of
the model's Python, needs nothing put back.
"""
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Tuple

import numpy as np

from gpt2np import ranges
from gpt2np.dist import SingleProcess
from gpt2np.outlier import exceeded

Batch = Tuple[np.ndarray, np.ndarray]          # (inputs, targets), each (B, T) token ids


@dataclass(frozen=True)
class AdamW:
    """AdamW and clipping settings (llm.c's defaults); the learning rate is per
    step, see train_step."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0        # global-norm clipping threshold; 0 = off


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; the update was not applied,
    the model is unchanged.

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


class PendingStep:
    """The result of a device step, read back asynchronously: loss and grad_norm (or unpacking it,
    as a StepResult) wait for the copy of the step's statistics and raise NonFiniteError when the
    step was not finite (the device skipped its update). done() says whether it is
    there without waiting."""

    def __init__(self, step: int, readback):
        self.step, self._readback, self._result = step, readback, None

    def done(self) -> bool:
        return self._result is not None or self._readback.done()

    def resolve(self) -> StepResult:
        """The StepResult (waits for the copy: a host sync); raises NonFiniteError for
        a non-finite step."""
        if self._result is None:
            stats = self._readback.result()
            self._result = StepResult(float(stats[0]),
                                      math.sqrt(float(stats[1])) if stats[1] >= 0 else math.nan)
        loss, norm = self._result
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise NonFiniteError(self.step, loss, norm)
        return self._result

    @property
    def loss(self) -> float:
        return self.resolve().loss

    @property
    def grad_norm(self) -> float:
        return self.resolve().grad_norm

    def __iter__(self):
        return iter(self.resolve())

    def __getitem__(self, i):
        return self.resolve()[i]


def train_step(model, next_batch: Callable[[], Batch], *, step: int, lr: float,
               accum_steps: int = 1,
               adamw: AdamW = AdamW(), dist=None, cuda_graphs: bool = False, limits=None):
    """One optimizer step of `model` on `accum_steps` micro-batches from next_batch().

    step: 0-based index (the NVTX range is "Train step {step}", AdamW's t is step + 1).
    dist: a process group (gpt2np.dist); None = this process alone. The loss and the gradients are
    averaged over micro-batches and processes; the grad norm is the global one, before clipping.
    cuda_graphs: on the device step, capture the step as a CUDA graph once per shape and replay it
    (under MPI as three graphs with the collectives between them; ignored while a profiler watches
    the launches, and on the host step).
    limits: an outlier.Limits (None: none): the update is skipped when the loss or the norm is above
    its limit (outlier.exceeded: the same comparisons on the host step and in the device
    step's AdamW kernel).
    Returns a StepResult (host step) or a PendingStep (device step, see the module docstring). A
    step whose loss or grad norm is not finite updates nothing and raises NonFiniteError: at once on
    the host step, when its result is read on the device step (every process sees the same averaged
    loss and global norm, so all of them raise together).
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
    dist = dist or SingleProcess()
    if hasattr(model.backend, "upload_tokens"):
        return _device_step(model, next_batch, step, lr, accum_steps, adamw, dist,
                            cuda_graphs, limits)
    with ranges.range(f"Train step {step}"):
        loss = 0.0
        for i in range(accum_steps):
            x, y = next_batch()
            loss += (model.forward(x, y, for_backward=True, grad_accum_steps=accum_steps)
                     / accum_steps)
            model.backward(accumulate=i > 0)
        dist.average_grads(model)
        loss = dist.average(loss)
        norm = dist.grad_norm(model)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise NonFiniteError(step, float(loss), float(norm))
        if limits is not None and exceeded(float(loss), float(norm), limits):
            # an outlier: nothing updated (every rank alike)
            return StepResult(float(loss), float(norm))
        model.update(lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay, step + 1,
                     adamw.grad_clip, grad_norm=norm, shard=dist.shard(model.num_parameters))
        dist.gather_params(model)
        model.backend.synchronize()
    return StepResult(float(loss), float(norm))


# model -> {shape key: _Captured}: the captured graphs of each model's device step
_GRAPHS = weakref.WeakKeyDictionary()


class _Captured(NamedTuple):
    graph: object
    # backend.scratch_generation when captured (a newer one: buffers moved)
    generation: int
    # model.m, model.v, model.master when captured (load_optimizer_state and, for
    state: tuple
                                  # bf16 parameters, load_params replace them)


def _device_step(model, next_batch, step, lr, accum_steps, adamw, dist, cuda_graphs, limits):
    be = model.backend
    with ranges.range(f"Train step {step}"):
        shape, staged = None, []
        # the uploads: tokens, their grouping (no host wait)
        for i in range(accum_steps):
            x, y = next_batch()
            staged.append(model.stage_batch(i, x, y))
            if shape not in (None, np.shape(x)):
                raise ValueError(f"micro-batch {i} is {np.shape(x)}, the first was {shape}")
            shape = np.shape(x)
        model.set_step_scalars(lr, adamw.beta1, adamw.beta2, adamw.weight_decay, step + 1, limits)
        shard = dist.shard(model.num_parameters)

        graphs_ok = (cuda_graphs and be.on_launch is None and hasattr(be.rt, "begin_capture")
                     and getattr(be.rt, "captures_gemms", True))
        cache = _GRAPHS.setdefault(model, {})
        segments = _device_segments(model, staged, adamw, dist, shard)
        # one process's step is one graph, MPI's three
        key = (shape, accum_steps, adamw, shard, len(segments))
        for i, (device_work, collective) in enumerate(segments):
            if not graphs_ok or cache.get(("eager", key)):
                device_work()
            else:
                _replay_or_capture(model, cache, (key, i), ("eager", key), device_work)
            if collective is not None:
                collective(model)
        return PendingStep(step, be.read_async(model.stats))


def _replay_or_capture(model, cache, key, eager_key, device_work):
    """Run device_work as the CUDA graph cached under key: replayed when it was captured with
    today's buffers, else run eagerly once (the first time: it allocates what the step needs) and
    captured the next time. A library call that refuses capture ends the capture, runs device_work
    eagerly and sets eager_key: the step's shape then runs eagerly from now on (one note).
    A replay runs none of the model's Python: what the step does was fixed by the arguments its
    calls were captured with (the key's shape and layout), and it leaves nothing to put back."""
    be = model.backend
    held = cache.get(key)
    state = (model.m, model.v, model.master)
    if (held is not None and held.generation == be.scratch_generation
            and all(a is b for a, b in zip(held.state, state))):
        held.graph.launch()
    elif (model.m is None or model.has_master_weights and model.master is None
          or held is None and not cache.get(("warm", key))):
        # eager first: it allocates what the step needs
        device_work()
        cache[("warm", key)] = True
    else:
        be.rt.begin_capture()
        try:
            device_work()
        except NotImplementedError as e:
            # a library call that refuses stream capture: run eagerly
            be.rt.end_capture()
            cache[eager_key] = True
            print(f"note: the step could not be captured as a CUDA graph ({e}); it runs eagerly",
                  file=sys.stderr, flush=True)
            device_work()
            return
        except BaseException:
            be.rt.end_capture()
            raise
        graph = be.rt.end_capture()
        cache[key] = _Captured(graph, be.scratch_generation, state)
        graph.launch()


def _device_segments(model, staged, adamw, dist, shard):
    """The device work of a step, everything after the uploads, as (device work, collective or None)
    pairs, each device work what one CUDA graph captures. One process: the whole step, one graph.
    Under MPI (any number of ranks, one included): the collectives run between the graphs, as they
    wait on the host (MPI, and NCCL for the collective watchdog), which no graph may hold; so a step
    is three graphs: forward and backward, the gradient norm, AdamW. staged: each micro-batch's
    (inputs, targets) token views (model.stage_batch)."""
    accum_steps = len(staged)

    def forward_backward():
        for i, tokens in enumerate(staged):
            model.forward(tokens=tokens, for_backward=True, grad_accum_steps=accum_steps,
                          device_loss=True, accumulate_loss=i > 0)
            model.backward(tokens, accumulate=i > 0)

    def grad_norm():
        model.grad_norm_device(shard if dist.zero_stage == 1 else None)

    def update():
        model.update_device(adamw.beta1, adamw.beta2, adamw.eps, adamw.grad_clip, shard=shard)

    if isinstance(dist, SingleProcess):
        return [(lambda: (forward_backward(), grad_norm(), update()), None)]
    return [(forward_backward, dist.average_grads), (grad_norm, dist.reduce_stats),
            (update, dist.gather_params)]

