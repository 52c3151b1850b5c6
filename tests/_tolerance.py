"""Float comparisons that hold on any CPU: tolerances relative to the values' scale.

Sharded and one-device runs sum the same terms in a different order, and the BLAS
kernels of one CPU (Intel, AMD, their vector widths) order them differently from
another's. The error that reordering introduces is proportional to the magnitude of
the tensor, not of each element: an element near zero in a tensor of size-1 values
can differ by ~1e-6 while its own value is 1e-7. An absolute tolerance tuned on one
machine therefore fails on the next. These helpers scale the absolute part of the
tolerance to the largest magnitude of the expected tensor.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_to_scale", "scaled_atol"]


def scaled_atol(want: torch.Tensor, rel: float) -> float:
    """``rel`` times the largest magnitude of ``want`` (at least ``rel`` times the dtype's tiny).

    Example::

        >>> scaled_atol(torch.tensor([0.5, -4.0]), 1e-4)
        0.0004
    """
    if want.numel() == 0 or not (want.is_floating_point() or want.is_complex()):
        return 0.0
    want = want.detach()
    finite = want[torch.isfinite(want)] if not want.is_complex() else want
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return rel * max(scale, torch.finfo(want.dtype).tiny)


def assert_close_to_scale(
    got: torch.Tensor, want: torch.Tensor, *, rel: float = 1e-4, what: str = ""
) -> None:
    """Assert ``|got - want| <= rel * (|want| + max|want|)`` elementwise.

    Example::

        >>> assert_close_to_scale(torch.tensor([1.0, 1e-9]), torch.tensor([1.0, 0.0]))
    """
    torch.testing.assert_close(
        got,
        want,
        rtol=rel,
        atol=scaled_atol(want, rel),
        equal_nan=True,
        msg=(lambda m: f"{what}: {m}") if what else None,
    )
