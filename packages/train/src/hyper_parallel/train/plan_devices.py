"""The accelerators ``hp-train --plan`` knows: peak compute, memory, node size and link speeds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hyper_parallel.config import ConfigError
from hyper_parallel.train.metrics import PEAK_TFLOPS

__all__ = ["DEVICES", "Device", "device_spec"]


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner's step-time estimate sees it.

    ``peak_tflops``: dense bfloat16 (the MFU denominator, :data:`~.metrics.PEAK_TFLOPS`).
    ``intra_node_gbps`` / ``inter_node_gbps``: GB/s (10^9 bytes) one device moves one way
    to its peers in a node (NVLink, HCCS, Infinity Fabric) and to other nodes (its share
    of the network: one NIC per device), the bus bandwidth a ring collective sees.

    Example::

        >>> DEVICES["h100"].gpus_per_node
        8
    """

    name: str
    peak_tflops: float
    memory_gib: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float


#: Published figures; links are one direction per device (NVLink 4: 900 GB/s both ways;
#: 400 Gb/s InfiniBand NDR per device = 50 GB/s; 200 Gb/s HDR / RoCE = 25 GB/s).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("h100", PEAK_TFLOPS["H100"], 80.0, 8, 450.0, 50.0),
        Device("h200", PEAK_TFLOPS["H200"], 141e9 / 2**30, 8, 450.0, 50.0),
        Device("h800", PEAK_TFLOPS["H800"], 80.0, 8, 200.0, 50.0),
        Device("a100", PEAK_TFLOPS["A100"], 80.0, 8, 300.0, 25.0),
        Device("a800", PEAK_TFLOPS["A800"], 80.0, 8, 200.0, 25.0),
        Device("mi300x", PEAK_TFLOPS["MI300X"], 192e9 / 2**30, 8, 448.0, 50.0),
        # HCCS: 7 links of 56 GB/s both ways to the other 7 NPUs of a node
        Device("910b", PEAK_TFLOPS["Ascend910B"], 64.0, 8, 196.0, 25.0),
    )
}


def device_spec(
    name: str,
    *,
    peak_tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    gpus_per_node: int | None = None,
) -> Device:
    """The table's ``name`` with the given figures replacing its own (ConfigError if unknown).

    Example::

        >>> device_spec("a100", peak_tflops=280.0).peak_tflops
        280.0
    """
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(
            f"expected one of {sorted(DEVICES)} (or give --peak-tflops, --intra-node-gbps and "
            f"--inter-node-gbps for another), found {name!r}",
            path="--device",
        )
    overrides = {
        "peak_tflops": peak_tflops,
        "intra_node_gbps": intra_node_gbps,
        "inter_node_gbps": inter_node_gbps,
        "gpus_per_node": gpus_per_node,
    }
    for flag, value in overrides.items():
        if value is not None and not value > 0:
            raise ConfigError(
                f"expected a number > 0, found {value}", path=f"--{flag.replace('_', '-')}"
            )
    table = DEVICES[key]
    return dataclasses.replace(
        table,
        peak_tflops=table.peak_tflops if peak_tflops is None else peak_tflops,
        intra_node_gbps=table.intra_node_gbps if intra_node_gbps is None else intra_node_gbps,
        inter_node_gbps=table.inter_node_gbps if inter_node_gbps is None else inter_node_gbps,
        gpus_per_node=table.gpus_per_node if gpus_per_node is None else gpus_per_node,
    )
