"""Upstream's module name for :class:`BaseModel` and :class:`ModelConfigConverter`.

Upstream hyper-parallel imports them from ``hyper_parallel.dmodule.model``; here they live
in :mod:`hyper_parallel.dmodule.base_model`.

Example::

    >>> from hyper_parallel.dmodule.model import BaseModel
    >>> BaseModel.__module__
    'hyper_parallel.dmodule.base_model'
"""

from hyper_parallel.dmodule.base_model import BaseModel, ModelConfigConverter

__all__ = ["BaseModel", "ModelConfigConverter"]
