"""Fully sharded data parallelism: torch's FSDP2 API (``fully_shard``) over hp DTensors.

Names and semantics follow ``torch.distributed.fsdp`` (``fully_shard``,
``FSDPModule``, ``MixedPrecisionPolicy``, ``OffloadPolicy``, ...). Parameters become
hp DTensor ``nn.Parameter``\\ s sharded over the mesh's data-parallel axis; each
``fully_shard`` group all-gathers once per unshard and reduce-scatters once per
backward, through :mod:`hyper_parallel.dtensor.collectives`.

Example::

    from hyper_parallel.dtensor import init_device_mesh
    from hyper_parallel.dtensor.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(x).sum().backward()      # gradients: (Shard(0),) DTensors, averaged over dp
"""

from hyper_parallel.dtensor.fsdp._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.dtensor.fsdp._fully_shard import (
    FSDPModule,
    HSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
