"""``enforce_layout``: a module boundary's declared layout, for the value and for its gradient."""

from __future__ import annotations

from collections.abc import Sequence

from hyper_parallel.dtensor._autograd import Redistribute
from hyper_parallel.dtensor._redistribute import check_redistribute_target
from hyper_parallel.dtensor._spec import normalize_placements
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.placement_types import Placement

__all__ = ["enforce_layout"]


def enforce_layout(dt: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Redistribute ``dt`` to ``placements`` and lay its gradient out the same way in backward.

    Unlike :meth:`DTensor.redistribute`, it records a node even when nothing moves, so
    a Partial gradient arriving from later ops is reduced here. That is what a module
    boundary with declared input placements needs: Megatron's "copy to parallel
    region" for a replicated block input, whose gradient is all-reduced once at the
    boundary instead of travelling on as partial sums.

    Example::

        x = enforce_layout(x, [Replicate()])   # forward: nothing moves; backward: one all-reduce
    """
    mesh = dt._spec.mesh
    dst = normalize_placements(placements, mesh.ndim, dt.ndim, where="enforce_layout")
    check_redistribute_target(dt._spec.placements, dst, where="enforce_layout")
    return Redistribute.apply(dt, dst, None, None)  # type: ignore[no-any-return]
