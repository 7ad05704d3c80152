"""GPU hardware specs used by the roofline step-latency model.

All numbers are per GPU and *dense* (NVIDIA datasheets quote tensor-core TFLOPS "with sparsity",
which is 2x the dense figure; we always use the dense number). Memory capacity is the datasheet
figure in decimal GB (1 GB = 1e9 B); ``nvidia-smi`` reports slightly more (e.g. 81,559 MiB = 85.5e9 B
on an H100 80GB), so capacities here are mildly conservative.

Link bandwidths are unidirectional bytes/s per GPU:

* ``nvlink_bw``: scale-up (NVLink/NVSwitch) bandwidth. Datasheets quote the bidirectional total
  (e.g. "NVLink 900 GB/s" on H100 SXM), so we divide by 2.
* ``scale_out_bw``: the scale-out NIC attached to each GPU. HGX/DGX Hopper and Blackwell nodes
  have one 400 Gb/s ConnectX-7 per GPU = 50e9 B/s; DeepSeek's H800 nodes likewise (DeepEP README:
  "H800 with CX7 InfiniBand 400 Gb/s RDMA network cards (~50 GB/s maximum bandwidth)").
"""

from __future__ import annotations

from dataclasses import dataclass

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    """Peak numbers of one GPU (dense tensor-core FLOPS, HBM, links)."""

    name: str
    #: dense BF16 tensor-core FLOP/s
    bf16_flops: float
    #: dense FP8 tensor-core FLOP/s
    fp8_flops: float
    #: HBM bandwidth, bytes/s
    hbm_bw: float
    #: HBM capacity, bytes
    hbm_bytes: float
    #: scale-up (NVLink) bandwidth per GPU, unidirectional bytes/s
    nvlink_bw: float
    #: scale-out network bandwidth per GPU (NIC), unidirectional bytes/s
    scale_out_bw: float
    #: GPUs sharing one NVLink domain (an HGX node)
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for field in ("bf16_flops", "fp8_flops", "hbm_bw", "hbm_bytes", "nvlink_bw", "scale_out_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"HardwareSpec {self.name!r}: {field} must be > 0")
        if self.gpus_per_node < 1:
            raise ValueError(f"HardwareSpec {self.name!r}: gpus_per_node must be >= 1")

    def peak_flops(self, dtype_bytes: int) -> float:
        """Dense tensor-core peak for operands of ``dtype_bytes`` (1 -> FP8, 2 -> BF16)."""
        if dtype_bytes == 1:
            return self.fp8_flops
        if dtype_bytes == 2:
            return self.bf16_flops
        raise ValueError(f"no tensor-core peak for {dtype_bytes}-byte operands (use 1=fp8 or 2=bf16)")


# NVIDIA H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column):
#   BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 TFLOPS dense (989.4);
#   FP8 Tensor Core 3,958 TFLOPS with sparsity -> 1,979 TFLOPS dense;
#   GPU memory 80 GB HBM3, 3.35 TB/s; NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction;
#   scale-out: one ConnectX-7 400 Gb/s per GPU in DGX/HGX H100 = 50 GB/s.
H100 = HardwareSpec(
    name="H100",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bw=3.35 * TB,
    hbm_bytes=80 * GB,
    nvlink_bw=900 * GB / 2,
    scale_out_bw=50 * GB,
)

# NVIDIA H800 SXM5 80GB (export variant of H100 SXM; same compute and HBM3 as H100 SXM per
# NVIDIA's H800 product brief), NVLink cut to 400 GB/s bidirectional -> 200 GB/s per direction.
# DeepSeek-V3 paper (arXiv 2412.19437, sec. 3.2.2) quotes NVLink 160 GB/s achievable and IB 50 GB/s;
# scale-out: CX7 InfiniBand 400 Gb/s per GPU (DeepSeek-V3 paper sec. 3.1; DeepEP README) = 50 GB/s.
H800 = HardwareSpec(
    name="H800",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bw=3.35 * TB,
    hbm_bytes=80 * GB,
    nvlink_bw=400 * GB / 2,
    scale_out_bw=50 * GB,
)

# NVIDIA H200 SXM 141GB (NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column):
#   same tensor-core peaks as H100 SXM (BF16 1,979 / FP8 3,958 TFLOPS with sparsity -> 989 / 1,979
#   dense); 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional; 400 Gb/s NIC per GPU (HGX H200).
H200 = HardwareSpec(
    name="H200",
    bf16_flops=989e12,
    fp8_flops=1979e12,
    hbm_bw=4.8 * TB,
    hbm_bytes=141 * GB,
    nvlink_bw=900 * GB / 2,
    scale_out_bw=50 * GB,
)

# NVIDIA B200 as in HGX B200 / DGX B200 (1,000 W configuration). NVIDIA HGX B200 spec table lists
# per GPU FP16/BF16 4.5 PFLOPS and FP8 9 PFLOPS *with sparsity* -> 2.25 / 4.5 PFLOPS dense.
# DGX B200 datasheet: 1,440 GB total GPU memory and 64 TB/s HBM3e bandwidth for 8 GPUs
# -> 180 GB and 8 TB/s per GPU; fifth-generation NVLink 1.8 TB/s bidirectional per GPU
# -> 900 GB/s per direction; 8x single-port ConnectX-7 400 Gb/s (one per GPU) = 50 GB/s.
B200 = HardwareSpec(
    name="B200",
    bf16_flops=2250e12,
    fp8_flops=4500e12,
    hbm_bw=8.0 * TB,
    hbm_bytes=180 * GB,
    nvlink_bw=1800 * GB / 2,
    scale_out_bw=50 * GB,
)

HARDWARE: dict[str, HardwareSpec] = {hw.name: hw for hw in (H100, H800, H200, B200)}


def get_hardware(name: str | HardwareSpec) -> HardwareSpec:
    """The preset called ``name`` (case-insensitive); a ``HardwareSpec`` is returned as is."""
    if isinstance(name, HardwareSpec):
        return name
    for key, spec in HARDWARE.items():
        if key.lower() == str(name).strip().lower():
            return spec
    raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(sorted(HARDWARE))}")
