"""The validation loss, as training logs it (`tel`) and `gpt2np eval` reports it."""
from gpt2np.progress import progress


def eval_loss(model, loader, max_batches=-1, desc="val", quiet_below=0):
    """(mean loss, batches) over the first max_batches batches of the loader from its start, as training's val loss
    counts them (-1: llm.c's count; more than there are wraps around: DataLoader.eval_batches), with a progress bar
    when there are quiet_below batches or more (training's val loss: only for a long one)."""
    loader.reset()
    n = loader.eval_batches(max_batches)
    total = 0.0
    with progress(total=n, desc=desc, unit="batch", quiet=n < quiet_below) as bar:
        for _ in range(n):
            x, y = loader.next_batch()
            total += model.forward(x, y)
            bar.update(1)
            bar.set_postfix_str(f"loss {total / bar.n:.4f}", refresh=False)
    return total / max(n, 1), n
