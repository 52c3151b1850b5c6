"""``parallelize_module``: apply parallel styles to a module, or to submodules by path."""

from __future__ import annotations

import warnings
from fnmatch import fnmatch

from torch import nn

from hyper_parallel.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.dtensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["parallelize_module"]

# Styles that turn parameters into DTensors: a module takes at most one of them.
_PARAMETER_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel)


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Parallelize ``module`` (in place) by a style, or its submodules by a plan of paths.

    As ``torch.distributed.tensor.parallel.parallelize_module``: a plan maps module
    paths (``"layers.*.attention.wq"``; each dot-separated token is an ``fnmatch``
    pattern over child names, ``""`` is ``module`` itself) to styles; a path matching
    nothing is skipped with a warning. ``src_data_rank`` is the rank whose parameter
    values are scattered (``None``: each rank keeps its own). The mesh is 1-D (slice a
    larger one: ``mesh["tp"]``); without one, the mesh entered with ``with mesh:``. Every entry is resolved and checked before any
    module changes, so a bad plan leaves the model untouched.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = parallelize_module(
            model, mesh, {"layers.*.w1": ColwiseParallel(), "layers.*.w2": RowwiseParallel()}
        )
    """
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module: no parallelize_plan given (and auto-parallel is not "
            "supported), so the module is left unchanged",
            stacklevel=2,
        )
        return module
    if device_mesh is None:
        device_mesh = current_mesh("parallelize_module")
    if isinstance(parallelize_plan, ParallelStyle):
        entries = [("", module, parallelize_plan)]
    elif isinstance(parallelize_plan, dict):
        entries = []
        for path, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(
                    f"parallelize_module: plan entry {path!r}: expected a ParallelStyle, "
                    f"found {type(style).__name__}"
                )
            matches = _resolve(module, path)
            if not matches:
                warnings.warn(
                    f"parallelize_module: plan key {path!r} matches no submodule of "
                    f"{type(module).__name__}; skipping it",
                    stacklevel=2,
                )
            entries.extend((fqn, sub, style) for fqn, sub in matches)
    else:
        raise TypeError(
            "parallelize_module: expected a ParallelStyle or a dict of module paths to "
            f"ParallelStyles as parallelize_plan, found {type(parallelize_plan).__name__}"
        )

    sharded: dict[int, str] = {}
    for fqn, sub, style in entries:
        where = repr(fqn) if fqn else f"the root {type(module).__name__}"
        style._check(sub, device_mesh, where)
        if isinstance(style, _PARAMETER_STYLES):
            if id(sub) in sharded:
                raise ValueError(
                    f"parallelize_module: {where} is given two parameter-sharding styles "
                    f"(by {sharded[id(sub)]!r} and {type(style).__name__}); expected one"
                )
            sharded[id(sub)] = type(style).__name__
    for _, sub, style in entries:
        style.src_data_rank = src_data_rank
        style._apply(sub, device_mesh)
    return module


def _resolve(module: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """The ``(fqn, submodule)`` pairs a plan path matches, token by token, in child order."""
    if path == "":
        return [("", module)]
    found: list[tuple[str, nn.Module]] = [("", module)]
    for token in path.split("."):
        found = [
            (f"{fqn}.{name}" if fqn else name, child)
            for fqn, parent in found
            for name, child in parent.named_children()
            if fnmatch(name, token)
        ]
    return found
