// device_launch_parameters.h (gpt2np CUDA emulator): everything a kernel needs comes from cuda_emu.h,
// which is force-included; this file only lets `#include <device_launch_parameters.h>` compile.
#pragma once
