"""ModuleList, ModuleDict and Sequential as :class:`Module` subclasses, made on first use.

Example::

    >>> from hyper_parallel.dmodule import ModuleList
    >>> layers = ModuleList([])
    >>> layers.init_states()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dmodule.module import Module

__all__ = ["ModuleDict", "ModuleList", "Sequential"]

if TYPE_CHECKING:

    class ModuleList(torch.nn.ModuleList, Module):
        """``nn.ModuleList`` that is a :class:`Module`."""

    class ModuleDict(torch.nn.ModuleDict, Module):
        """``nn.ModuleDict`` that is a :class:`Module`."""

    class Sequential(torch.nn.Sequential, Module):
        """``nn.Sequential`` that is a :class:`Module`."""


def __getattr__(name: str) -> Any:
    """Make ``ModuleList``/``ModuleDict``/``Sequential`` from the platform's containers."""
    if name in __all__:
        cls = Module.from_nn_module(getattr(torch.nn, name))
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
