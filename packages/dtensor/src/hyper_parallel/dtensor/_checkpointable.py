"""How DTensors leave a process and come back: pickling, deepcopy, and DCP's checkpointable protocol.

A ``DTensor`` pickles as its class, its local shard, its mesh (which pickles by value,
see :mod:`~hyper_parallel.dtensor.device_mesh`), placements and global shape/stride,
``requires_grad`` and its Python attributes (so ``nn.Parameter`` survives).
``torch.load(..., weights_only=True)`` accepts them: the classes and rebuild functions
are in torch's safe globals once :mod:`hyper_parallel.dtensor` is imported, as torch's
own DTensor classes are once ``torch.distributed.tensor`` is.

``torch.distributed.checkpoint`` (DCP) sees a DTensor through three methods
(``torch/distributed/_checkpointable.py``): the write items of this rank's shard,
the chunk this rank holds, and the local tensor of that chunk. Replicas of a shard
have the same index on every rank and DCP's global plan writes them once; loading
reads whichever saved chunks overlap this rank's chunk, which is how a checkpoint
reshards onto another mesh.

The DTensor class imports this module; nothing here imports the class (new DTensors
are built with the class at hand, which a pickle carries), so imports flow one way.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    local_indices,
    local_shape_and_offset,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement, _StridedShard

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    from hyper_parallel.dtensor._tensor import DTensor

__all__ = [
    "create_chunk_list",
    "create_write_items",
    "deepcopy_dtensor",
    "get_tensor_shard",
    "rebuild_dtensor",
    "reduce_dtensor",
]


# -- DTensor pickling -----------------------------------------------------------------


def reduce_dtensor(dt: DTensor) -> tuple[Callable[..., DTensor], tuple[object, ...]]:
    """``DTensor.__reduce_ex__``: local shard, layout, ``requires_grad``, attributes, rank."""
    spec = dt._spec
    local = dt._local_tensor.detach()
    return (
        rebuild_dtensor,
        (
            type(dt),
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


def rebuild_dtensor(
    cls: type[DTensor],
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool,
    attributes: dict[str, object],
    saved_by_rank: int,
) -> DTensor:
    """Unpickle a DTensor (``torch.load(weights_only=True)`` may call it: a safe global)."""
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
    result = cls(local, DTensorSpec(mesh, placements_t, meta), requires_grad=requires_grad)
    result.__dict__.update(attributes)
    ensure_leaf_grad_hook(result)
    return result


def deepcopy_dtensor(dt: DTensor, memo: dict[int, object]) -> DTensor:
    """``DTensor.__deepcopy__``: a new leaf with a copied shard, the same (shared) mesh.

    As for a plain tensor, only a leaf may be deep-copied, and its ``.grad`` is copied too.
    """
    if not dt.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
            f"protocol at the moment; this DTensor of shape {tuple(dt.shape)} is the output "
            "of an op (use .detach() first)"
        )
    local = copy.deepcopy(dt._local_tensor.detach(), memo)
    result = type(dt)(local, dt._spec, requires_grad=dt.requires_grad)
    memo[id(dt)] = result
    result.__dict__.update(copy.deepcopy(dict(dt.__dict__), memo))
    if dt.grad is not None:
        result.grad = copy.deepcopy(dt.grad, memo)
    ensure_leaf_grad_hook(result)
    return result


# -- DCP's checkpointable protocol --------------------------------------------------------


_Chunk = tuple[torch.Size, torch.Size, tuple[int, ...]]
"""``(sizes, global offsets, local offsets)`` of one box of a rank's shard."""


def _local_chunks(dt: DTensor, where: str) -> list[_Chunk]:
    """The boxes of the global tensor this rank holds (none outside the mesh).

    One box, unless a ``_StridedShard`` spreads the rank's positions of a dim: then one
    box per run of consecutive positions of each such dim.
    """
    spec = dt._spec
    if spec.has_partial():
        raise ValueError(
            f"{where}: a DTensor with placements {spec.placements} holds partial values; "
            "checkpointing needs every value reduced: redistribute it to Replicate() first"
        )
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return []
    if not any(isinstance(p, _StridedShard) for p in spec.placements):
        sizes, offsets = local_shape_and_offset(
            spec.shape, spec.mesh.shape, coordinate, spec.placements
        )
        return [(torch.Size(sizes), torch.Size(offsets), (0,) * len(sizes))]
    # per dim, runs of consecutive global positions: (global start, local start, length)
    runs: list[list[tuple[int, int, int]]] = []
    held = local_indices(spec.shape, spec.mesh.shape, coordinate, spec.placements)
    for size, positions in zip(spec.shape, held, strict=True):
        if positions is None:
            runs.append([(0, 0, size)])
            continue
        dim_runs: list[tuple[int, int, int]] = []
        for local, position in enumerate(positions):
            if dim_runs and dim_runs[-1][0] + dim_runs[-1][2] == position:
                start, local_start, length = dim_runs[-1]
                dim_runs[-1] = (start, local_start, length + 1)
            else:
                dim_runs.append((position, local, 1))
        runs.append(dim_runs or [(size, 0, 0)])
    return [
        (
            torch.Size(r[2] for r in box),
            torch.Size(r[0] for r in box),
            tuple(r[1] for r in box),
        )
        for box in itertools.product(*runs)
    ]


def create_write_items(dt: DTensor, fqn: str) -> list[WriteItem]:
    """``DTensor.__create_write_items__``: one shard write item for this rank's chunk."""
    # torch.distributed.checkpoint takes seconds to import: only a DCP call pays for it.
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

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
        for sizes, offsets, _ in _local_chunks(dt, f"DCP save of {fqn!r}")
    ]


def create_chunk_list(dt: DTensor) -> list[ChunkStorageMetadata]:
    """``DTensor.__create_chunk_list__``: the chunk this rank holds (none outside the mesh)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # see above

    return [
        ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        for sizes, offsets, _ in _local_chunks(dt, "DCP load")
    ]


def get_tensor_shard(dt: DTensor, index: MetadataIndex) -> torch.Tensor:
    """``DTensor.__get_tensor_shard__``: the local tensor (DCP reads into it in place).

    Called once per read or written chunk, so it checks only what can be wrong here.
    """
    spec = dt._spec
    if spec.has_partial():
        _local_chunks(dt, f"DCP access to {index.fqn!r}")  # raises the Partial error
    if not any(isinstance(p, _StridedShard) for p in spec.placements):
        return dt._local_tensor
    for sizes, offsets, local_offsets in _local_chunks(dt, f"DCP access to {index.fqn!r}"):
        if index.offset is None or tuple(offsets) == tuple(index.offset):
            box = dt._local_tensor
            for dim, (start, length) in enumerate(zip(local_offsets, sizes, strict=True)):
                if length != box.shape[dim]:
                    box = box.narrow(dim, start, length)
            return box  # a view: DCP reads into it in place
    raise ValueError(
        f"DCP access to {index.fqn!r}: this rank holds no chunk at offsets {index.offset}"
    )
