"""Device profiles: datasheet specs and the roofline coefficients the latency model uses.

A :class:`Hardware` holds, per phase (prefill, decode, vision encode), the three
coefficients of an *additive roofline*::

    t = FLOPs * seconds_per_flop + bytes * seconds_per_byte + overhead_s

with ``seconds_per_flop = 1 / (peak FLOP/s x achievable fraction)`` and
``seconds_per_byte = 1 / (HBM bytes/s x achievable fraction)``. The sum (rather than
the max of the classic roofline, Williams et al., CACM 2009) is an upper bound on
the max that is never more than 2x above it; it is linear in the coefficients, so
measured profiles can be fitted by least squares (see :mod:`mm_serve.planner.fit`),
the same form as DistServe's latency model (arXiv:2401.09670, Appendix A).

Datasheet numbers (dense BF16/FP16 tensor-core peak, HBM bandwidth, NVLink per GPU
per direction, one InfiniBand NIC per GPU) are NVIDIA's: A100 SXM4 80GB (312 TFLOP/s,
2.039 TB/s, NVLink3 300 GB/s, HDR 200 Gb/s), H100 SXM5 80GB (989 TFLOP/s,
3.35 TB/s, NVLink4 450 GB/s, NDR 400 Gb/s), H200 SXM 141GB (989 TFLOP/s, 4.8 TB/s,
NVLink4 450 GB/s, NDR 400 Gb/s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

GIB = 1 << 30


@dataclass(frozen=True)
class PhaseCoefficients:
    """Additive-roofline coefficients of one phase (seconds per FLOP, per byte, per call)."""

    seconds_per_flop: float
    seconds_per_byte: float
    overhead_s: float

    def time(self, flops: float, bytes_moved: float) -> float:
        """Seconds for ``flops`` FLOPs and ``bytes_moved`` bytes of device memory traffic."""
        return flops * self.seconds_per_flop + bytes_moved * self.seconds_per_byte + self.overhead_s


@dataclass(frozen=True)
class ParallelCoefficients:
    """Coefficients measured on one instance of several devices (threads on a CPU): the whole
    model's FLOPs and bytes, collectives included in the times (nothing divided, no all-reduce added)."""

    prefill: PhaseCoefficients
    decode: PhaseCoefficients
    encode: PhaseCoefficients


@dataclass(frozen=True)
class Hardware:
    """One device kind as the latency model sees it (all values achievable, not peak).

    ``tensor_parallel`` holds, by degree, the coefficients of instances of that many devices
    where a profile measured them (:mod:`mm_serve.planner.fit`); other degrees are priced from
    one device's coefficients (:mod:`mm_serve.planner.latency_model`).
    """

    name: str
    memory_bytes: float  # device memory per GPU
    prefill: PhaseCoefficients
    decode: PhaseCoefficients
    encode: PhaseCoefficients
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bandwidth: float  # bytes/s per GPU across nodes (InfiniBand / Ethernet)
    collective_latency_s: float  # fixed cost of one all-reduce or p2p send, seconds
    memory_utilization: float = 0.9  # fraction of memory usable for weights + KV
    activation_reserve_bytes: float = 2 * GIB  # per GPU, for activations and workspace
    tensor_parallel: Mapping[int, ParallelCoefficients] = field(default_factory=dict, hash=False)  # measured, by degree


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak and fixed per-call overheads (seconds).

    The defaults are calibrated so that the simulator reproduces DistServe's
    Figure 1 (OPT-13B on one A100-80GB, 512 prompt / 64 output tokens, P90 TTFT
    0.4 s, P90 TPOT 0.04 s): prefill-only 5.6 req/s, decode-only 10 req/s,
    colocated 1.6 req/s measured; this model gives 6.0, 10.5 and 1.7. The same
    fractions are assumed for the H100 and H200 profiles.
    """

    prefill_compute: float = 0.5  # large GEMMs (MFU)
    decode_compute: float = 0.5  # skinny GEMMs
    encode_compute: float = 0.5  # ViT at a few hundred positions per image
    memory_bandwidth: float = 0.7  # streaming weights / KV pages
    link: float = 0.7  # NCCL bus bandwidth over link peak
    prefill_overhead_s: float = 0.006  # scheduling + kernel launches per forward
    decode_overhead_s: float = 0.006
    encode_overhead_s: float = 0.002
    collective_latency_s: float = 20e-6


@dataclass(frozen=True)
class HardwareSpec:
    """Datasheet numbers of one GPU (peak FLOP/s, bytes/s, bytes)."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    nvlink_bandwidth: float  # per GPU per direction
    internode_bandwidth: float  # per GPU

    def to_hardware(self, eff: Efficiency | None = None) -> Hardware:
        """Derive the latency model's coefficients with the given efficiencies."""
        e = eff or Efficiency()
        per_byte = 1.0 / (self.hbm_bandwidth * e.memory_bandwidth)
        return Hardware(
            name=self.name,
            memory_bytes=self.memory_bytes,
            prefill=PhaseCoefficients(1.0 / (self.peak_flops * e.prefill_compute), per_byte,
                                      e.prefill_overhead_s),
            decode=PhaseCoefficients(1.0 / (self.peak_flops * e.decode_compute), per_byte,
                                     e.decode_overhead_s),
            encode=PhaseCoefficients(1.0 / (self.peak_flops * e.encode_compute), per_byte,
                                     e.encode_overhead_s),
            intra_node_bandwidth=self.nvlink_bandwidth * e.link,
            inter_node_bandwidth=self.internode_bandwidth * e.link,
            collective_latency_s=e.collective_latency_s,
        )


SPECS: Mapping[str, HardwareSpec] = MappingProxyType({
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, 80 * GIB, 300e9, 25e9),
    "h100-80gb": HardwareSpec("h100-80gb", 989e12, 3.35e12, 80 * GIB, 450e9, 50e9),
    "h200-141gb": HardwareSpec("h200-141gb", 989e12, 4.8e12, 141e9, 450e9, 50e9),
})


def hardware_names() -> list[str]:
    """The built-in profile names accepted by ``--hardware``."""
    return sorted(SPECS)
