"""How DTensors and meshes leave a process and come back: pickling, and DCP's checkpointable protocol.

A ``DeviceMesh`` pickles as its value (device type, ranks, axis names); unpickled in
a process that holds a mesh of the same value it reattaches to that mesh's process
groups, as torch's mesh resolves its groups by name. Elsewhere it comes back
*detached*: its shape, names and coordinate are there, its groups are not, and a
collective on it raises naming the mesh to build first.

A ``DTensor`` pickles as its local shard, its mesh, placements and global
shape/stride, ``requires_grad`` and its Python attributes (so ``nn.Parameter``
survives). ``torch.load(..., weights_only=True)`` accepts them: the classes and
rebuild functions are in torch's safe globals once :mod:`hyper_parallel.dtensor`
is imported, as torch's own DTensor classes are once ``torch.distributed.tensor``
is.

``torch.distributed.checkpoint`` (DCP) sees a DTensor through three methods
(``torch/distributed/_checkpointable.py``): the write items of this rank's shard,
the chunk this rank holds, and the local tensor of that chunk. Replicas of a shard
have the same index on every rank and DCP's global plan writes them once; loading
reads whichever saved chunks overlap this rank's chunk, which is how a checkpoint
reshards onto another mesh.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, local_shape_and_offset
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    from hyper_parallel.dtensor._tensor import DTensor
    from hyper_parallel.dtensor.device_mesh import DeviceMesh

__all__ = [
    "create_chunk_list",
    "create_write_items",
    "deepcopy_dtensor",
    "get_tensor_shard",
    "reduce_dtensor",
    "reduce_mesh",
    "register_safe_globals",
    "remember_mesh",
]

MeshKey = tuple[str, tuple[int, ...], tuple[int, ...], "tuple[str, ...] | None"]

# The meshes alive in this process, by value: what an unpickled mesh reattaches to.
# Weak, so a mesh nobody holds is not kept alive (nor its groups) by having been built.
_live_meshes: weakref.WeakValueDictionary[MeshKey, DeviceMesh] = weakref.WeakValueDictionary()


def remember_mesh(mesh: DeviceMesh) -> None:
    """Record ``mesh``, which holds its process groups, as the live mesh of its value."""
    _live_meshes.setdefault(mesh._value_key, mesh)


# -- DeviceMesh ---------------------------------------------------------------------


def reduce_mesh(mesh: DeviceMesh) -> tuple[Callable[..., DeviceMesh], tuple[object, ...]]:
    """``DeviceMesh.__reduce__``: the mesh's value and the rank that pickled it."""
    ranks = mesh.mesh.tolist()
    return (_rebuild_mesh, (mesh.device_type, ranks, mesh.mesh_dim_names, mesh.get_rank()))


def _rebuild_mesh(
    device_type: str, ranks: list[Any], mesh_dim_names: tuple[str, ...] | None, rank: int
) -> DeviceMesh:
    from hyper_parallel.dtensor.device_mesh import DeviceMesh

    tensor = torch.tensor(ranks, dtype=torch.int64)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    key: MeshKey = (device_type, tuple(tensor.shape), tuple(tensor.flatten().tolist()), names)
    live = _live_meshes.get(key)
    if live is not None:
        return live
    detached = DeviceMesh.__new__(DeviceMesh)
    detached._setup(device_type, tensor, names, rank, groups={})
    return detached


# -- DTensor pickling -----------------------------------------------------------------


def reduce_dtensor(dt: DTensor) -> tuple[Callable[..., DTensor], tuple[object, ...]]:
    """``DTensor.__reduce_ex__``: local shard, layout, ``requires_grad``, attributes, rank."""
    spec = dt._spec
    local = dt._local_tensor.detach()
    return (
        _rebuild_dtensor,
        (
            local,
            spec.mesh,
            spec.placements,
            spec.shape,
            spec.tensor_meta.stride,
            dt.requires_grad,
            dict(dt.__dict__),
            spec.mesh.get_rank(),
        ),
    )


def _rebuild_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool,
    attributes: dict[str, object],
    saved_by_rank: int,
) -> DTensor:
    from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
    from hyper_parallel.dtensor._tensor import DTensor

    placements_t = tuple(placements)
    if mesh.get_rank() != saved_by_rank and not all(p.is_replicate() for p in placements_t):
        # The shard belongs to the saving rank's coordinate: taking it as this rank's
        # would silently make another global tensor.
        raise ValueError(
            f"DTensor unpickling: this shard of a tensor of shape {tuple(shape)} with "
            f"placements {placements_t} was saved by rank {saved_by_rank} and is loaded on "
            f"rank {mesh.get_rank()} of {mesh}; load each rank's file on the rank that saved "
            "it, or save the full tensor (dt.full_tensor()) to move it between ranks"
        )
    meta = TensorMeta(shape, stride, local.dtype)
    result = DTensor(local, DTensorSpec(mesh, placements_t, meta), requires_grad=requires_grad)
    result.__dict__.update(attributes)
    ensure_leaf_grad_hook(result)
    return result


def deepcopy_dtensor(dt: DTensor, memo: dict[int, object]) -> DTensor:
    """``DTensor.__deepcopy__``: a new leaf with a copied shard, the same (shared) mesh.

    As for a plain tensor, only a leaf may be deep-copied, and its ``.grad`` is copied too.
    """
    from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
    from hyper_parallel.dtensor._tensor import DTensor

    if not dt.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            f"protocol at the moment; this DTensor of shape {tuple(dt.shape)} is the output "
            "of an op (use .detach() first)"
        )
    local = copy.deepcopy(dt._local_tensor.detach(), memo)
    result = DTensor(local, dt._spec, requires_grad=dt.requires_grad)
    memo[id(dt)] = result
    result.__dict__.update(copy.deepcopy(dict(dt.__dict__), memo))
    if dt.grad is not None:
        result.grad = copy.deepcopy(dt.grad, memo)
    ensure_leaf_grad_hook(result)
    return result


def register_safe_globals() -> None:
    """Let ``torch.load(..., weights_only=True)`` rebuild DTensors and meshes.

    torch.distributed.tensor registers its own DTensor classes the same way on import.

    Example::

        register_safe_globals(); torch.load("state.pt")  # a state dict holding DTensors
    """
    from hyper_parallel.dtensor._tensor import DTensor
    from hyper_parallel.dtensor.device_mesh import DeviceMesh

    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        DTensor,
        DeviceMesh,
        Shard,
        Replicate,
        Partial,
        _rebuild_mesh,
        _rebuild_dtensor,
    ]
    torch.serialization.add_safe_globals(allowed)


# -- DCP's checkpointable protocol --------------------------------------------------------


def _local_chunk(dt: DTensor, where: str) -> tuple[torch.Size, torch.Size] | None:
    """``(sizes, offsets)`` of this rank's chunk, or None when the rank is outside the mesh."""
    spec = dt._spec
    if spec.has_partial():
        raise ValueError(
            f"{where}: a DTensor with placements {spec.placements} holds partial values; "
            "checkpointing needs every value reduced: redistribute it to Replicate() first"
        )
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    sizes, offsets = local_shape_and_offset(
        spec.shape, spec.mesh.shape, coordinate, spec.placements
    )
    return torch.Size(sizes), torch.Size(offsets)


def create_write_items(dt: DTensor, fqn: str) -> list[WriteItem]:
    """``DTensor.__create_write_items__``: one shard write item for this rank's chunk."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunk = _local_chunk(dt, f"DCP save of {fqn!r}")
    if chunk is None:
        return []
    sizes, offsets = chunk
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(dt._local_tensor),
                size=torch.Size(dt._spec.shape),
            ),
        )
    ]


def create_chunk_list(dt: DTensor) -> list[ChunkStorageMetadata]:
    """``DTensor.__create_chunk_list__``: the chunk this rank holds (none outside the mesh)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunk = _local_chunk(dt, "DCP load")
    if chunk is None:
        return []
    sizes, offsets = chunk
    return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]


def get_tensor_shard(dt: DTensor, index: MetadataIndex) -> torch.Tensor:
    """``DTensor.__get_tensor_shard__``: the local tensor (DCP reads into it in place).

    Called once per read or written chunk, so it checks only what can be wrong here.
    """
    if dt._spec.has_partial():
        _local_chunk(dt, f"DCP access to {index.fqn!r}")  # raises the Partial error
    return dt._local_tensor
