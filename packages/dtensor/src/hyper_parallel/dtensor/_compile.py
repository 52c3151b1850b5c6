"""How ``torch.compile`` sees hp-dtensor: a clean graph break at every DTensor op.

Dynamo is told two things, once, when it is first imported:

* ``DTensor`` is a *non-traceable* tensor subclass
  (``torch._dynamo.config.nontraceable_tensor_subclasses``): dynamo does not fake it
  into a graph, so an op that reads a DTensor ends the graph before it, runs eagerly
  through ``__torch_dispatch__`` (collectives included), and dynamo resumes after it;
* hp-dtensor's own files, and those of the platform adapters, are not traced (dynamo's
  skip list, as for torch's internals): ``from_local``, ``to_local``, ``redistribute``,
  the parallel styles' hooks, FSDP's hooks and the collectives run as eager calls,
  never half-traced.

The plain-tensor code between those calls compiles as usual, and the user code those
eager calls call back into (a module's ``forward``) is compiled frame by frame. Torch's
own DTensor is traceable instead (its ops and collectives inside one graph); the cost of
the break is one graph per stretch of plain-tensor code and no fusion across a DTensor
op (``packages/dtensor/README.md``, "torch.compile").

Registering waits for dynamo's import (``import torch._dynamo`` costs seconds and most
programs never compile): a finder on ``sys.meta_path`` runs :func:`register_with_dynamo`
after ``torch._dynamo`` has loaded, or at once when it is already loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.platform import installed_platforms

__all__ = ["install", "register_with_dynamo"]

_DYNAMO = "torch._dynamo"
_registered = False


def register_with_dynamo() -> None:
    """Make every DTensor op a clean graph break for ``torch.compile`` (idempotent).

    Runs by itself when dynamo is imported; calling it again does nothing.

    Example::

        >>> register_with_dynamo()
    """
    global _registered
    if _registered:
        return
    import torch._dynamo.config
    import torch._dynamo.trace_rules

    torch._dynamo.config.nontraceable_tensor_subclasses.add(DTensor)
    # The package's own directory on dynamo's skip list (as torch's internals are), and
    # the platform adapters' too: a frame the eager hp-dtensor code calls is otherwise
    # compiled by itself, and an adapter's collectives are no graph's business.
    for package in _skipped_packages():
        torch._dynamo.trace_rules.add(package)
    _registered = True


def _skipped_packages() -> list[str]:
    """hp-dtensor, the platform protocol and each installed adapter's package."""
    packages = ["hyper_parallel.dtensor", "hyper_parallel.platform"]
    for entry_point in installed_platforms().values():
        if entry_point.module not in packages:  # a package skips its whole directory
            packages.append(entry_point.module)
    return packages


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register_with_dynamo` once ``torch._dynamo`` has been executed."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            register_with_dynamo()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterDynamoImport)]


def install() -> None:
    """Register now if dynamo is loaded, else when it loads (called by the package's import).

    Example::

        >>> install()
    """
    if _DYNAMO in sys.modules:
        register_with_dynamo()
    elif not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())
