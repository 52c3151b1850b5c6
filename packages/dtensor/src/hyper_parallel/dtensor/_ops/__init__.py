"""Sharding rules, one module per family of ops; importing this package registers them all."""

from hyper_parallel.dtensor._ops import (  # noqa: F401  (foreach ops, random fills)
    foreach,
    losses,
    matrix,
    nn,
    pointwise,
    random,
    reductions,
    specials,
    views,
)

__all__ = ["losses", "matrix", "nn", "pointwise", "reductions", "specials", "views"]
