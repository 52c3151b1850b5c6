"""Sharding rules, one module per family of ops; importing this package registers them all."""

from hyper_parallel.dtensor._ops import (
    along_dim,
    complex,
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
    "along_dim",
    "complex",
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
