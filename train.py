#!/usr/bin/env python3
"""llm.c's entry point: `python train.py FLAGS` is `gpt2np train FLAGS` (gpt2np/cli/train.py)."""
import sys

try:
    # build_parser and parse_config: for tests and scripts
    from gpt2np.cli.train import build_parser, main, parse_config  # noqa: F401
except KeyboardInterrupt:
    # Ctrl-C while importing, before the run's own handling: one line too
    print("error: interrupted", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
