"""The layout of a DTensor: mesh, placements, global metadata, and the chunk arithmetic."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard, _StridedShard

if TYPE_CHECKING:
    from hyper_parallel.dtensor.device_mesh import DeviceMesh

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "check_same_mesh",
    "chunk_bounds",
    "chunk_range",
    "contiguous_strides",
    "global_strides",
    "local_indices",
    "local_shape_and_offset",
    "local_shard",
    "normalize_placements",
    "partial_to_replicate",
    "replicate_all",
    "strided_positions",
]


class TensorMeta:
    """Global shape, stride and dtype of a distributed tensor (an immutable value)."""

    __slots__ = ("_hash", "dtype", "shape", "stride")

    def __init__(self, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> None:
        self.shape = tuple(map(int, shape))
        self.stride = tuple(map(int, stride))
        self.dtype = dtype
        self._hash = hash((self.shape, self.stride, self.dtype))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorMeta)
            and self.shape == other.shape
            and self.stride == other.stride
            and self.dtype == other.dtype
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"TensorMeta(shape={self.shape}, stride={self.stride}, dtype={self.dtype})"


class DTensorSpec:
    """Where a DTensor lives: its mesh, one placement per mesh axis, and its global meta.

    Specs are immutable, hashable values: the dispatcher's cache keys are built from them.
    """

    __slots__ = ("_hash", "_key", "_partial", "mesh", "placements", "tensor_meta")

    def __init__(
        self, mesh: DeviceMesh, placements: tuple[Placement, ...], tensor_meta: TensorMeta
    ) -> None:
        self.mesh = mesh
        self.placements = placements
        self.tensor_meta = tensor_meta
        self._hash = hash((mesh, placements, tensor_meta))
        # the dispatcher's fast key for this spec: equal specs have equal keys, hashed in
        # C (the spec's own __hash__ is a Python call); tagged, so no other argument is one
        self._key = (DTensorSpec, self._hash)
        # read per tensor by the foreach specials (an optimizer step asks it of every state)
        self._partial = any(p.is_partial() for p in placements)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        """The same tensor laid out with other placements."""
        return DTensorSpec(self.mesh, placements, self.tensor_meta)

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def has_partial(self) -> bool:
        return self._partial

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not DTensorSpec and not isinstance(other, DTensorSpec):
            return False
        # TensorMeta's and DeviceMesh's equality inlined, identity first: the plan cache
        # compares equal specs of distinct objects on every hit
        meta, theirs = self.tensor_meta, other.tensor_meta
        return (
            self._hash == other._hash
            and self.placements == other.placements
            and (
                meta is theirs
                or (
                    meta.shape == theirs.shape
                    and meta.stride == theirs.stride
                    and meta.dtype == theirs.dtype
                )
            )
            and (self.mesh is other.mesh or self.mesh == other.mesh)
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"DTensorSpec(placements={self.placements}, shape={self.shape}, mesh={self.mesh})"


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` is split like ``torch.chunk``.

    The first chunks hold ``ceil(size / num_chunks)`` elements; later ones may be
    shorter or empty.

    Example::

        >>> [chunk_range(5, 4, i) for i in range(4)]
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    full = -(-size // num_chunks) if num_chunks > 0 else 0
    start = min(full * index, size)
    end = min(start + full, size)
    return start, end - start


def chunk_bounds(size: int, num_chunks: int) -> tuple[int, ...]:
    """The ``num_chunks + 1`` boundaries of ``torch.chunk``-style chunks of ``size``.

    Example::

        >>> chunk_bounds(5, 4)
        (0, 2, 4, 5, 5)
    """
    full = -(-size // num_chunks)
    return tuple(min(full * i, size) for i in range(num_chunks + 1))


def normalize_placements(
    placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int, *, where: str
) -> tuple[Placement, ...]:
    """Validate placements against a mesh and tensor, wrapping negative shard dims.

    Raises ``ValueError`` naming ``where`` when the count or a shard dim is off.
    """
    if type(placements) is tuple:
        # the common case, checked once per (placements, mesh, tensor) shape
        try:
            return _normalized(placements, mesh_ndim, tensor_ndim)
        except (ValueError, TypeError):
            pass  # re-raised below with the caller's ``where``
    return _normalize(placements, mesh_ndim, tensor_ndim, where=where)


@functools.lru_cache(maxsize=4096)
def _normalized(
    placements: tuple[Placement, ...], mesh_ndim: int, tensor_ndim: int
) -> tuple[Placement, ...]:
    return _normalize(placements, mesh_ndim, tensor_ndim, where="")


def _normalize(
    placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int, *, where: str
) -> tuple[Placement, ...]:
    if isinstance(placements, Placement):
        raise TypeError(
            f"{where}: placements must be a sequence with one Placement per mesh axis, "
            f"found a bare {placements!r}; write ({placements!r},)"
        )
    result: list[Placement] = []
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{where}: expected {mesh_ndim} placement(s), one per mesh axis, "
            f"found {len(placements)}: {tuple(placements)}"
        )
    for axis, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                f"{where}: mesh axis {axis}: expected a Placement (Shard, Replicate, Partial), "
                f"found {p!r}"
            )
        if isinstance(p, (Shard, _StridedShard)):
            dim = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= dim < tensor_ndim:
                raise ValueError(
                    f"{where}: mesh axis {axis}: {p!r} is out of range "
                    f"for a tensor with {tensor_ndim} dim(s)"
                )
            if dim != p.dim:
                p = Shard(dim) if isinstance(p, Shard) else _StridedShard(dim, sf=p.split_factor)
        result.append(p)
    return tuple(result)


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shard shape and global offset of the rank at ``coordinate``.

    Mesh axes that shard the same tensor dim nest in axis order: the first axis
    splits the dim, the next splits each piece again.

    Example::

        >>> local_shape_and_offset((5, 4), (2,), (1,), (Shard(0),))
        ((2, 4), (3, 0))
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    strided = False
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            start, length = chunk_range(shape[p.dim], mesh_shape[axis], coordinate[axis])
            offset[p.dim] += start
            shape[p.dim] = length
        elif isinstance(p, _StridedShard):
            strided = True
    if not strided:
        return tuple(shape), tuple(offset)
    # a strided shard holds positions that need not be contiguous: its offset is the first
    # one (the dim's size when it holds none), as torch's compute_local_shape_and_global_offset
    shape, offset = list(global_shape), [0] * len(global_shape)
    for dim, positions in enumerate(
        local_indices(global_shape, mesh_shape, coordinate, placements)
    ):
        if positions is not None:
            shape[dim] = len(positions)
            offset[dim] = positions[0] if positions else global_shape[dim]
    return tuple(shape), tuple(offset)


def strided_positions(size: int, split_factor: int, num_chunks: int, index: int) -> list[int]:
    """Positions (of ``range(size)``) that chunk ``index`` of ``_StridedShard(split_factor)`` holds.

    The dim is cut into ``split_factor`` pieces and each piece into ``num_chunks`` chunks
    (both as ``torch.chunk``); chunk ``index`` is the ``index``-th chunk of every piece.

    Example::

        >>> strided_positions(8, 2, 2, 1)
        [2, 3, 6, 7]
    """
    positions: list[int] = []
    for j in range(split_factor):
        start, length = chunk_range(size, split_factor, j)
        sub, sub_length = chunk_range(length, num_chunks, index)
        positions.extend(range(start + sub, start + sub + sub_length))
    return positions


def local_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> list[list[int] | None]:
    """Per tensor dim, the global positions this rank holds in order (``None``: the whole dim).

    Mesh axes apply in order, each to what the earlier ones left: ``Shard`` takes its
    ``torch.chunk``, ``_StridedShard`` its chunk of every piece.

    Example::

        >>> local_indices((8,), (2,), (1,), (_StridedShard(0, sf=2),))
        [[2, 3, 6, 7]]
    """
    result: list[list[int] | None] = [None] * len(global_shape)
    for axis, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        held = result[p.dim]
        if held is None:
            held = list(range(global_shape[p.dim]))
        n, r = mesh_shape[axis], coordinate[axis]
        if isinstance(p, Shard):
            start, length = chunk_range(len(held), n, r)
            result[p.dim] = held[start : start + length]
        else:
            result[p.dim] = [held[k] for k in strided_positions(len(held), p.split_factor, n, r)]
    return result


def local_shard(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """The rank at ``coordinate``'s shard of ``full`` laid out as ``placements`` (a new tensor).

    Example::

        >>> local_shard(torch.arange(5), (2,), (1,), (Shard(0),))
        tensor([3, 4])
    """
    if any(isinstance(p, _StridedShard) for p in placements):
        local = full
        for dim, positions in enumerate(
            local_indices(full.shape, mesh_shape, coordinate, placements)
        ):
            if positions is not None:
                index = torch.tensor(positions, dtype=torch.long, device=full.device)
                local = local.index_select(dim, index)
        return local.clone(memory_format=torch.contiguous_format)
    shape, offset = local_shape_and_offset(full.shape, mesh_shape, coordinate, placements)
    local = full
    for dim, (start, length) in enumerate(zip(offset, shape, strict=True)):
        if length != full.shape[dim]:
            local = local.narrow(dim, start, length)
    return local.clone(memory_format=torch.contiguous_format)


_REPLICATE = Replicate()


def replicate_all(ndim: int) -> tuple[Placement, ...]:
    """Replicate on every one of ``ndim`` mesh axes.

    Example::

        >>> replicate_all(2)
        (Replicate(), Replicate())
    """
    return _replicate_all(ndim)


@functools.lru_cache(maxsize=16)
def _replicate_all(ndim: int) -> tuple[Placement, ...]:
    return (_REPLICATE,) * ndim


def partial_to_replicate(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """``placements`` with every Partial made Replicate: the layout once partial values are reduced.

    It is the layout of a gradient of a leaf, of a value a fallback wrote, of a tensor
    a random fill overwrote.

    Example::

        >>> partial_to_replicate((Partial(), Shard(0)))
        (Replicate(), Shard(dim=0))
    """
    if not any(p.is_partial() for p in placements):
        return placements
    return tuple(_REPLICATE if p.is_partial() else p for p in placements)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``.

    Example::

        >>> contiguous_strides((2, 3, 4))
        (12, 4, 1)
    """
    return _contiguous_strides(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def global_strides(
    local_strides: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """The global tensor's strides for even shards of a local tensor of ``local_strides`` (torch's rule).

    Per mesh axis that shards dim ``d``, every stride at least dim ``d``'s grows by the
    axis size: the strides of the local tensor's memory order, widened to the global
    tensor's, so a transposed shard gives a transposed global tensor.

    Example::

        >>> global_strides((8, 1, 32), (4,), (Shard(1),))  # a permuted (4, 8, 8) shard
        (32, 1, 128)
    """
    strides = list(local_strides)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            sharded = strides[p.dim]
            for i, stride in enumerate(strides):
                if i != p.dim and stride >= sharded:
                    strides[i] = stride * mesh_shape[axis]
    return tuple(strides)


def check_same_mesh(found: DeviceMesh, expected: DeviceMesh, *, where: str) -> None:
    """Raise ``ValueError`` unless ``found`` is ``expected`` (moving between meshes is unsupported)."""
    if found != expected:
        raise ValueError(
            f"{where}: moving between meshes is not supported; the tensor is on {expected}, "
            f"found {found}"
        )
