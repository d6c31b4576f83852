"""CUDA backend of gpt2np: kernels/*.cu run through CuPy (GPU) or the CPU emulator."""
