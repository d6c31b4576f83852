// cuda_runtime.h (gpt2np CUDA emulator): everything a kernel needs comes from cuda_emu.h,
// which is force-included; this file only lets `#include <cuda_runtime.h>` compile.
#pragma once
