"""Peak dense bf16 throughput, memory and memory bandwidth of the accelerators we plan for (MFU and `estimate`).

Each figure is the vendor datasheet's dense bf16 tensor-core number, without the 2:4 structured sparsity that the
datasheets print next to it (that is twice this). Sources (NVIDIA product datasheets / architecture whitepapers):
- H100 SXM5 80 GB and H100 PCIe: "NVIDIA H100 Tensor Core GPU" datasheet — BF16 1,979 / 1,513 TFLOPS with
  sparsity → 989.4 / 756.5 dense; HBM3 3.35 TB/s, HBM2e 2.0 TB/s; 80 GB.
- H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet — BF16 1,979 TFLOPS with sparsity → 989.4 dense; 141 GB HBM3e,
  4.8 TB/s.
- H800 SXM: the H100 SXM's Hopper die with a narrower NVLink; NVIDIA's H800 datasheet prints the same BF16 1,979
  TFLOPS with sparsity → 989.4 dense; 80 GB HBM3, 3.35 TB/s.
- A100 40 GB / 80 GB SXM4: "NVIDIA A100 Tensor Core GPU" datasheet — BF16 312 TFLOPS dense (624 with sparsity);
  1,555 GB/s (40 GB HBM2) and 2,039 GB/s (80 GB HBM2e).
- L40S: "NVIDIA L40S" datasheet — BF16 733 TFLOPS with sparsity → 366 dense; 48 GB GDDR6, 864 GB/s.
- A10: "NVIDIA A10 Tensor Core GPU" datasheet — BF16 250 TFLOPS with sparsity → 125 dense; 24 GB GDDR6, 600 GB/s.
- RTX 4090: "NVIDIA Ada GPU Architecture" whitepaper, Appendix A — peak BF16 tensor TFLOPS with FP32 accumulate
  165.2 (330.3 with sparsity); 24 GB GDDR6X, 1,008 GB/s.
- cpu: no fixed figure; give the peak (e.g. measured: benchmarks/estimate_vs_published.py times a matmul) with
  `--peak-tflops` / `log.peak_tflops`.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Device:
    key: str  # what --gpu takes
    peak_tflops: float | None  # dense bf16; None: unknown (cpu) until given
    memory_gib: float | None
    bandwidth_gbs: float | None  # memory bandwidth, GB/s (10^9)
    matches: tuple[str, ...]  # lower-case substrings of torch.cuda.get_device_name() that mean this device

    def with_overrides(self, peak_tflops: float | None = None, bandwidth_gbs: float | None = None,
                       memory_gib: float | None = None) -> Device:  # fmt: skip
        return Device(
            self.key,
            self.peak_tflops if peak_tflops is None else peak_tflops,
            self.memory_gib if memory_gib is None else memory_gib,
            self.bandwidth_gbs if bandwidth_gbs is None else bandwidth_gbs,
            self.matches,
        )


GB = 1e9 / 2**30  # GiB per GB: datasheets count memory in 10^9 bytes

# order matters for matching names: the more specific first (H100 PCIe before H100)
DEVICES: dict[str, Device] = {
    d.key: d
    for d in (
        Device("h100-pcie", 756.5, 80 * GB, 2000, ("h100 pcie",)),
        Device("h100", 989.4, 80 * GB, 3350, ("h100",)),
        Device("h200", 989.4, 141 * GB, 4800, ("h200",)),
        Device("h800", 989.4, 80 * GB, 3350, ("h800",)),
        Device("a100-40gb", 312.0, 40 * GB, 1555, ("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb")),
        Device("a100", 312.0, 80 * GB, 2039, ("a100",)),
        Device("l40s", 366.0, 48 * GB, 864, ("l40s",)),
        Device("a10", 125.0, 24 * GB, 600, ("a10",)),
        Device("rtx4090", 165.2, 24 * GB, 1008, ("rtx 4090",)),
        Device("cpu", None, None, None, ()),
    )
}


def device_named(name: str) -> Device:
    """The table's entry for --gpu NAME (case-insensitive); a clear error listing the known ones otherwise."""
    key = name.strip().lower()
    if key not in DEVICES:
        known = ", ".join(DEVICES)
        raise UserError(f"--gpu: unknown device '{name}'{did_you_mean(key, list(DEVICES))}; known: {known}")
    return DEVICES[key]


def device_of_name(device_name: str) -> Device | None:
    """The entry whose pattern occurs in a reported device name (torch.cuda.get_device_name(), e.g. 'NVIDIA H100 80GB
    HBM3'); None when no entry matches (then MFU needs log.peak_tflops)."""
    lowered = device_name.lower()
    for device in DEVICES.values():
        if any(pattern in lowered for pattern in device.matches):
            return device
    return None


def peak_flops_of(device_name: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device by its reported name, or `override_tflops` when given; None when unknown."""
    if override_tflops is not None:
        return override_tflops * 1e12
    device = device_of_name(device_name)
    return None if device is None or device.peak_tflops is None else device.peak_tflops * 1e12
