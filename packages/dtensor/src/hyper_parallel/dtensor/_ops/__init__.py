"""Sharding rules, one module per family of ops; importing this package registers them all.

Two layers (``docs/DTENSOR_INTERNALS.md``): rule modules sit below planning and import
only ``_registry`` and what is under it; modules of specials (whole-call handlers:
``specials.py``, ``random.py``, ``*_specials.py``) sit above the DTensor class.
"""

from hyper_parallel.dtensor._ops import (
    along_dim,
    complex,
    foreach,
    foreach_specials,
    loss_specials,
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
    "foreach_specials",
    "loss_specials",
    "losses",
    "matrix",
    "nn",
    "pointwise",
    "random",
    "reductions",
    "specials",
    "views",
]
