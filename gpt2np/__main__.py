"""`python -m gpt2np COMMAND ...` is the `gpt2np` console script (gpt2np/cli/main.py)."""
import sys

from gpt2np.cli.main import main

sys.exit(main())
