"""Peak throughput of common devices, the roofline derived from it, and model FLOPs utilisation.

Numbers are NVIDIA datasheet / architecture whitepaper peaks at boost clock, DENSE (the
datasheets' tensor-core numbers "with sparsity" are halved here). Units: TFLOP/s and GB/s
(1 GB = 1e9 bytes).
    fp32: plain FP32 on the CUDA cores (no tensor cores): what a hand-written kernel can reach.
    tf32: TF32 tensor-core matmul (cuBLAS with CUBLAS_TF32_TENSOR_OP_MATH).
    bf16, fp16: tensor-core matmul with FP32 accumulation.
None means the device has no such unit. The "cpu" entry knows no peaks (they depend on the
machine), so a report asked for `--device cpu` shows achieved GFLOP/s and GB/s without a % of peak;
the profiler on the CPU measures a roofline where it runs instead (cpu_roof.measure).

    lookup("NVIDIA H100 80GB HBM3")  -> DeviceSpec for the H100 SXM
    peak_flops("A100-SXM4-80GB", "tf32") -> 156e12
    roofline("NVIDIA L4", "fp32", matmul_precision="tf32") -> Roofline (profiling.render.report)
"""
import re
from dataclasses import dataclass
from typing import Optional, Tuple, Union

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one device: TFLOP/s per precision and memory bandwidth in GB/s."""
    name: str
    fp32: Optional[float]
    tf32: Optional[float]
    bf16: Optional[float]
    fp16: Optional[float]
    mem_gbps: Optional[float]
    patterns: Tuple[str, ...] = ()   # lower-case name fragments that identify the device

    def tflops(self, precision: str) -> Optional[float]:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: expected one of "
                             f"{', '.join(PRECISIONS)}")
        return getattr(self, precision)


#           name                 fp32   tf32   bf16   fp16   GB/s    name fragments
_TABLE = [
    DeviceSpec("V100 SXM2",        15.7,  None,  None,  125.0,  900.0, ("v100", "v100 sxm2")),
    DeviceSpec("V100 PCIe",        14.0,  None,  None,  112.0,  900.0, ("v100 pcie",)),
    DeviceSpec("V100S PCIe",       16.4,  None,  None,  130.0, 1134.0, ("v100s",)),
    DeviceSpec("T4",                8.1,  None,  None,   65.0,  320.0, ("t4",)),
    DeviceSpec("A100 40GB",        19.5, 156.0, 312.0,  312.0, 1555.0,
               ("a100", "a100 sxm4 40gb", "a100 pcie 40gb", "a100 40gb")),
    DeviceSpec("A100 80GB SXM",    19.5, 156.0, 312.0,  312.0, 2039.0,
               ("a100 sxm4 80gb", "a100 80gb", "a100 sxm 80gb")),
    DeviceSpec("A100 80GB PCIe",   19.5, 156.0, 312.0,  312.0, 1935.0,
               ("a100 80gb pcie", "a100 pcie 80gb")),
    DeviceSpec("A10",              31.2,  62.5, 125.0,  125.0,  600.0, ("a10",)),
    DeviceSpec("L4",               30.3,  60.0, 121.0,  121.0,  300.0, ("l4",)),
    DeviceSpec("L40S",             91.6, 183.0, 366.5,  366.5,  864.0, ("l40s",)),
    DeviceSpec("H100 SXM",         67.0, 494.5, 989.5,  989.5, 3350.0,
               ("h100", "h100 sxm", "h100 sxm5", "h100 80gb hbm3")),
    DeviceSpec("H100 PCIe",        51.0, 378.0, 756.5,  756.5, 2000.0, ("h100 pcie",)),
    DeviceSpec("H100 NVL",         60.0, 417.5, 835.5,  835.5, 3900.0, ("h100 nvl",)),
    DeviceSpec("H200 SXM",         67.0, 494.5, 989.5,  989.5, 4800.0, ("h200", "h200 sxm")),
    DeviceSpec("H200 NVL",         60.0, 417.5, 835.5,  835.5, 4800.0, ("h200 nvl",)),
    # GeForce Ampere/Ada: tensor-core FP32 accumulation runs at half the FP16-accumulate rate.
    DeviceSpec("RTX 3060",         12.7,  12.7,  25.5,   25.5,  360.0, ("rtx 3060",)),
    DeviceSpec("RTX 3070",         20.3,  20.3,  40.6,   40.6,  448.0, ("rtx 3070",)),
    DeviceSpec("RTX 3080",         29.8,  29.8,  59.5,   59.5,  760.0, ("rtx 3080",)),
    DeviceSpec("RTX 3090",         35.6,  35.6,  71.0,   71.0,  936.0, ("rtx 3090",)),
    DeviceSpec("RTX 4070",         29.1,  29.1,  58.3,   58.3,  504.2, ("rtx 4070",)),
    DeviceSpec("RTX 4070 Ti",      40.1,  40.1,  80.2,   80.2,  504.2, ("rtx 4070 ti",)),
    DeviceSpec("RTX 4080",         48.7,  48.7,  97.5,   97.5,  716.8, ("rtx 4080",)),
    DeviceSpec("RTX 4090",         82.6,  82.6, 165.2,  165.2, 1008.0, ("rtx 4090",)),
    DeviceSpec("cpu",              None,  None,  None,   None,   None, ("cpu",)),
]
DEVICES = {spec.name: spec for spec in _TABLE}


class UnknownDeviceError(ValueError):
    """A device name that matches no entry of the peak table."""


def words(name: str) -> list:
    """A device name's words, lower case: 'NVIDIA A100-SXM4-80GB' -> nvidia, a100, sxm4, 80gb."""
    return re.findall(r"[a-z0-9]+", name.lower())


def matches(fragment: str, name: str) -> bool:
    """Whether a run of the name's whole words spells the fragment, spaces, hyphens and case aside:
    'rtx 4090' is in 'NVIDIA GeForce RTX 4090' and in 'RTX4090'; 'a10' is neither in 'a100' nor in
    'a10g'."""
    wanted, have = "".join(words(fragment)), words(name)
    runs = ("".join(have[i:j]) for i in range(len(have)) for j in range(i + 1, len(have) + 1))
    return wanted in runs


def lookup(device_name: str) -> Optional[DeviceSpec]:
    """The table entry for a device name as CUDA reports it ('NVIDIA GeForce RTX 4090') or as a
    user types it ('RTX4090', 'rtx-4090'), or None.

    Matching is by name fragment; the entry with the longest matching fragment wins, so
    'NVIDIA H100 PCIe' is the PCIe part and 'NVIDIA H100 80GB HBM3' the SXM part.
    """
    if isinstance(device_name, DeviceSpec):
        return device_name
    best, best_len = None, 0
    for spec in _TABLE:
        for fragment in spec.patterns + (" ".join(words(spec.name)),):
            if len(fragment) > best_len and matches(fragment, device_name):
                best, best_len = spec, len(fragment)
    return best


def require(device_name: Union[str, DeviceSpec]) -> DeviceSpec:
    """Like lookup, but an unknown name raises UnknownDeviceError naming the known devices."""
    spec = lookup(device_name)
    if spec is None:
        known = ", ".join(DEVICES)
        raise UnknownDeviceError(f"unknown device {device_name!r}: no peak numbers for it "
                                 f"(known: {known})")
    return spec


def peak_flops(device_name: Union[str, DeviceSpec], precision: str = "fp32") -> Optional[float]:
    """Peak FLOP/s of the device at that precision; None when unknown or unsupported."""
    spec = lookup(device_name)
    tflops = spec.tflops(precision) if spec is not None else None
    return None if tflops is None else tflops * 1e12


def peak_bandwidth(device_name: Union[str, DeviceSpec]) -> Optional[float]:
    """Peak memory bandwidth of the device in bytes/s; None when unknown."""
    spec = lookup(device_name)
    return None if spec is None or spec.mem_gbps is None else spec.mem_gbps * 1e9


@dataclass(frozen=True)
class Roofline:
    """The two ceilings a kernel is measured against.

    peak_flops: FLOP/s for ordinary kernels; matmul_peak_flops: FLOP/s for GEMM kernels
    (tensor cores when TF32/BF16 is on; defaults to peak_flops); peak_bw: bytes/s.
    A kernel with arithmetic intensity (FLOP/byte) above the ridge point peak_flops/peak_bw is
    compute bound, otherwise memory bound. None ceilings mean "unknown" (reports then give no
    bound and no % of peak).
    """
    device: str
    peak_flops: Optional[float]
    peak_bw: Optional[float]
    matmul_peak_flops: Optional[float] = None

    def flops_ceiling(self, is_gemm: bool) -> Optional[float]:
        if is_gemm and self.matmul_peak_flops is not None:
            return self.matmul_peak_flops
        return self.peak_flops

    def ridge(self, is_gemm: bool = False) -> Optional[float]:
        """FLOP/byte where the compute and memory ceilings meet."""
        flops = self.flops_ceiling(is_gemm)
        if flops is None or not self.peak_bw:
            return None
        return flops / self.peak_bw


def roofline(device: Union[str, DeviceSpec], precision: str = "fp32",
             matmul_precision: Optional[str] = None) -> Roofline:
    """The Roofline of a known device (UnknownDeviceError for an unknown one).

    precision: the rate of hand-written kernels (fp32 on CUDA cores for gpt2np's kernels);
    matmul_precision: the rate of the cuBLAS GEMMs (e.g. 'tf32'), defaults to precision.
    """
    spec = require(device)
    matmul = peak_flops(spec, matmul_precision) if matmul_precision else None
    return Roofline(spec.name, peak_flops(spec, precision), peak_bandwidth(spec), matmul)


def flops_per_token(num_params: int, num_layers: int, channels: int, seq_len: int) -> int:
    """Training FLOPs per token, as llm.c estimates them: 6N + 6*L*C*T.

    6N: forward (2N) plus backward (4N) of every weight's multiply-add; 6*L*C*T: the attention
    score and value matmuls (QK^T and AV, forward and backward) over a causal context of T.
    """
    return 6 * int(num_params) + 6 * int(num_layers) * int(channels) * int(seq_len)


def mfu(flops_per_tok: float, tokens_per_sec: float, device: Union[str, DeviceSpec],
        precision: str = "tf32") -> Optional[float]:
    """Model FLOPs utilisation: achieved model FLOP/s / the device's peak (a fraction, 0..1).

    precision: the peak to divide by; llm.c uses TF32 for fp32 training and BF16 for bf16.
    None when the device or its peak at that precision is unknown (e.g. 'cpu').
    """
    peak = peak_flops(device, precision)
    if not peak:
        return None
    return flops_per_tok * tokens_per_sec / peak
