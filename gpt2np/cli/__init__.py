"""The gpt2np command and its subcommands."""
