"""Distributed tensors: DeviceMesh, placements, DTensor, redistribute.

Names and semantics follow ``torch.distributed.tensor``.

Example::

    from hyper_parallel.dtensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
"""

import torch as _torch

from hyper_parallel.dtensor import (
    _ops,  # noqa: F401  (registers the sharding rules)
    collectives,
)
from hyper_parallel.dtensor._checkpointable import rebuild_dtensor as _rebuild_dtensor
from hyper_parallel.dtensor._clip_grad import clip_grad_norm_
from hyper_parallel.dtensor._compile import install as _install_compile_support
from hyper_parallel.dtensor._dispatch import implicit_replication
from hyper_parallel.dtensor._distribute import distribute_tensor
from hyper_parallel.dtensor._distribute_module import distribute_module
from hyper_parallel.dtensor._factories import empty, full, ones, rand, randn, zeros
from hyper_parallel.dtensor._layout import enforce_layout
from hyper_parallel.dtensor._planning import FallbackError, FallbackWarning, strict_mode
from hyper_parallel.dtensor._seeds import RandomSeedWarning, manual_seed, set_random_sync
from hyper_parallel.dtensor._spec import normalize_placements
from hyper_parallel.dtensor._tensor import (
    DTensor,
    clear_plan_cache,
    fallback_counts,
    plan_cache_size,
    reset_fallback_counts,
)
from hyper_parallel.dtensor.debug import CommDebugMode
from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.dtensor.device_mesh import _rebuild_mesh as _rebuild_mesh
from hyper_parallel.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _strided_shard,
    _StridedShard,
)

# As torch.distributed.tensor does for its classes: torch.load(weights_only=True) may rebuild them.
_torch.serialization.add_safe_globals(
    [DTensor, DeviceMesh, Shard, Replicate, Partial, _rebuild_mesh, _rebuild_dtensor]
)
_torch.serialization.add_safe_globals([_StridedShard, _strided_shard])
# torch.compile: every DTensor op a clean graph break (registered when dynamo loads)
_install_compile_support()

__all__ = [
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "FallbackError",
    "FallbackWarning",
    "Partial",
    "Placement",
    "RandomSeedWarning",
    "Replicate",
    "Shard",
    "clear_plan_cache",
    "clip_grad_norm_",
    "collectives",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "enforce_layout",
    "fallback_counts",
    "full",
    "implicit_replication",
    "init_device_mesh",
    "manual_seed",
    "normalize_placements",
    "ones",
    "plan_cache_size",
    "rand",
    "randn",
    "reset_fallback_counts",
    "set_random_sync",
    "strict_mode",
    "zeros",
]
