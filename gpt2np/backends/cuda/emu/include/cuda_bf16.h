// cuda_bf16.h (gpt2np CUDA emulator): half-precision types are not emulated.
#error "cuda_bf16.h: half/bfloat16 types are not supported by the gpt2np CUDA emulator (float32 kernels only)"
