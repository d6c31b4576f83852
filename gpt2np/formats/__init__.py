"""Files gpt2np reads and writes: llm.c's model and state files, the tokenizer, debug
state, Hugging Face."""
