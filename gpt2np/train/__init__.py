"""The training run behind train.py: setup, the loop, logs, checkpoints and run folders."""
