"""Sharding rules, one module per family of ops; importing this package registers them all."""

from hyper_parallel.dtensor._ops import (
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

__all__ = [
    "foreach",
    "losses",
    "matrix",
    "nn",
    "pointwise",
    "random",
    "reductions",
    "specials",
    "views",
]
