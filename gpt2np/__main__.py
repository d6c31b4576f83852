"""`python -m gpt2np COMMAND ...` is the `gpt2np` console script (gpt2np/commands.py)."""
import sys

from gpt2np.commands import main

sys.exit(main())
