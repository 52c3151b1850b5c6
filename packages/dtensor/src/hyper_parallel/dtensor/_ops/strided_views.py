"""Views that keep a shard by striding it: ``flatten`` of a non-leading shard and its inverse.

A view merges runs of input dims into runs of output dims (``view_groups``). A group
sharded by one mesh axis, on one of its dims, reads in row-major order as ``F`` equal
pieces, each cut into one chunk per rank: the shard of a flattened ``(P, S, I)`` run
(``Shard`` of the ``S`` dim) is ``_StridedShard(sf=P)`` of the flat dim, as torch writes
it. The same description is then found in the output run: the first output dim whose
leading dims' product ``P'`` divides ``F`` and whose size the remaining factor
``F / P'`` divides is sharded (``Shard`` when that factor is 1, else
``_StridedShard(sf=F / P')``). Both ends must cut the piece into the same chunks as
``torch.chunk`` of whole rows would; else the axis is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hyper_parallel.dtensor._spec import DTensorSpec, chunk_bounds
from hyper_parallel.dtensor.placement_types import Placement, Shard, _StridedShard

__all__ = ["strided_view_placement"]


def _rows_chunk_alike(rows: int, row_size: int, n: int) -> bool:
    """True when ``torch.chunk`` of ``rows * row_size`` elements cuts between whole rows."""
    return [b * row_size for b in chunk_bounds(rows, n)] == list(chunk_bounds(rows * row_size, n))


def strided_view_placement(
    spec: DTensorSpec,
    out_shape: Sequence[int],
    groups: list[tuple[list[int], list[int]]],
    axis: int,
) -> Placement | None:
    """The output placement of mesh axis ``axis`` in a view, or None when it cannot stay sharded.

    Example::

        # (8, 4, 6) Shard(2) viewed as (192,): _StridedShard(dim=0, sf=32)
        strided_view_placement(spec, (192,), [([0, 1, 2], [0])], 0)
    """
    p = spec.placements[axis]
    if not isinstance(p, (Shard, _StridedShard)):
        return p
    in_shape = spec.shape
    group = next(((i, o) for i, o in groups if p.dim in i), None)
    if group is None:
        return None
    in_g, out_g = group
    # one mesh axis shards this run of dims, or the pieces would nest
    for other, q in enumerate(spec.placements):
        if other != axis and isinstance(q, (Shard, _StridedShard)) and q.dim in in_g:
            return None
    n = spec.mesh.shape[axis]
    m = in_g.index(p.dim)
    f = p.split_factor if isinstance(p, _StridedShard) else 1
    size = in_shape[p.dim]
    if size % f:
        return None
    inner = math.prod(in_shape[k] for k in in_g[m + 1 :])
    if not _rows_chunk_alike(size // f, inner, n):
        return None
    pieces = math.prod(in_shape[k] for k in in_g[:m]) * f
    piece = size // f * inner
    for j, o in enumerate(out_g):
        before = math.prod(out_shape[k] for k in out_g[:j])
        if pieces % before or out_shape[o] % (pieces // before):
            continue
        split = pieces // before
        after = math.prod(out_shape[k] for k in out_g[j + 1 :])
        rows = out_shape[o] // split
        if rows * after != piece or not _rows_chunk_alike(rows, after, n):
            continue
        return Shard(o) if split == 1 else _StridedShard(o, sf=split)
    return None
