"""Sharding rules, one module per family of ops; importing this package registers them all."""

from hyper_parallel.dtensor._ops import matrix, nn, pointwise, reductions, specials, views

__all__ = ["matrix", "nn", "pointwise", "reductions", "specials", "views"]
