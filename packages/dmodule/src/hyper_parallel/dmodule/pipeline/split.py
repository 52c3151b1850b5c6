"""How a declarative model is cut into pipeline stages, and each stage's module built from it.

Nothing here communicates: a stage is a copy of the model in which the parts that other
stages hold are replaced by :class:`PassThrough` modules, and the layer list keeps only
this stage's layers under their original indices, so every state keeps its original FQN.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from hyper_parallel.dmodule.containers import ModuleList
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.types import NamedPlacement

__all__ = [
    "PassThrough",
    "PipelineSplit",
    "StageLayers",
    "StagePlan",
    "build_stage",
    "even_starts",
    "plan_stages",
]

#: The placements of the activation sent between stages, per mesh axis, or a function of
#: the model's Config giving them (``None``: plain tensors, no layout to rebuild).
ActivationLayout = NamedPlacement | Callable[[Any], NamedPlacement | None] | None


@dataclass(frozen=True)
class PipelineSplit:
    """Where a model can be cut: its layer list, what comes before it and what after.

    ``layers`` names the model's :class:`~hyper_parallel.dmodule.ModuleList` of repeated
    blocks, cut between blocks; ``first`` names the children that run before the first
    block (they go to the first stage), ``last`` those that run after the last block (to
    the last stage). The model's ``forward`` must run on a stage, where the children of
    other stages are :class:`PassThrough` modules (``h = tok_embeddings(tokens)`` then
    returns its input) and ``layers`` holds only the stage's blocks. ``activation`` is the
    layout of the tensor passed between stages once parallelized (e.g. ``{"tp":
    Replicate()}``), or a function of the model's Config returning it; torch's pipeline
    sends plain tensors, and the receiving stage rebuilds the DTensor with it.

    Example::

        >>> from hyper_parallel.dtensor import Replicate
        >>> split = PipelineSplit(layers="layers", first=("tok_embeddings",),
        ...                       last=("norm", "output"), activation={"tp": Replicate()})
        >>> split.last
        ('norm', 'output')
    """

    layers: str = "layers"
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    activation: ActivationLayout = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise TypeError(f"PipelineSplit.layers: expected a child name, found {self.layers!r}")
        for field_name in ("first", "last"):
            names = getattr(self, field_name)
            if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
                raise TypeError(
                    f"PipelineSplit.{field_name}: expected a tuple of child names, found {names!r}"
                )
            object.__setattr__(self, field_name, tuple(names))
        named = set(self.first) | set(self.last)
        if self.layers in named or len(named) != len(self.first) + len(self.last):
            raise ValueError(
                f"PipelineSplit: each child is named once; found layers={self.layers!r}, "
                f"first={self.first}, last={self.last}"
            )

    def activation_layout(self, config: object) -> NamedPlacement | None:
        """The declared layout of the activations between stages of a model of ``config``.

        Example::

            >>> PipelineSplit().activation_layout(None) is None
            True
        """
        if callable(self.activation):
            return self.activation(config)
        return self.activation


class PassThrough(Module):
    """Stands in for a part of the model that another stage holds: returns its first input.

    Example::

        >>> PassThrough()(torch.ones(2)).tolist()
        [1.0, 1.0]
    """

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """``x`` unchanged."""
        del args, kwargs
        return x

    def extra_repr(self) -> str:
        return f"held by another stage: {self.name!r}" if self.name else ""


class StageLayers(ModuleList):
    """A stage's blocks under their original indices: ``layers.5`` stays ``layers.5``.

    Iterates its blocks in order like the full list; ``stage.layers[5]`` is block 5.

    Example::

        >>> blocks = StageLayers({3: PassThrough(), 4: PassThrough()})
        >>> [name for name, _ in blocks.named_children()], len(blocks)
        (['3', '4'], 2)
    """

    def __init__(self, blocks: Mapping[int, torch.nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and str(index) in self._modules:
            return self._modules[str(index)]
        raise IndexError(
            f"StageLayers: this stage holds layers {self.indices()}, not {index!r} (its blocks "
            f"keep their indices in the full model)"
        )

    __repr__ = torch.nn.Module.__repr__  # ModuleList's renumbers the blocks from 0

    def indices(self) -> list[int]:
        """The original indices of this stage's blocks, in order."""
        return [int(name) for name in self._modules]

    def append(self, module: torch.nn.Module) -> StageLayers:
        raise TypeError("StageLayers: a stage's blocks are fixed by the split; nothing to append")

    def insert(self, index: int, module: torch.nn.Module) -> None:
        raise TypeError("StageLayers: a stage's blocks are fixed by the split; nothing to insert")


@dataclass(frozen=True)
class StagePlan:
    """Stage ``index`` of ``num_stages``: blocks ``[start, stop)`` and the children it holds."""

    index: int
    num_stages: int
    start: int
    stop: int
    children: tuple[str, ...]

    @property
    def is_first(self) -> bool:
        """True for stage 0."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage."""
        return self.index == self.num_stages - 1


def even_starts(n_layers: int, num_stages: int) -> list[int]:
    """The first block of each stage when ``n_layers`` are shared evenly (earlier stages take the extra).

    The last stage also holds the norm and the head (and computes the loss), so a
    remainder goes to the earlier stages.

    Example::

        >>> even_starts(5, 2), even_starts(8, 4)
        ([0, 3], [0, 2, 4, 6])
    """
    base, extra = divmod(n_layers, num_stages)
    starts, start = [], 0
    for stage in range(num_stages):
        starts.append(start)
        start += base + (1 if stage < extra else 0)
    return starts


def plan_stages(
    model: torch.nn.Module,
    split: PipelineSplit,
    num_stages: int,
    starts: Sequence[int] | None = None,
    *,
    where: str = "pipeline",
) -> list[StagePlan]:
    """Check the model against ``split`` and cut it into ``num_stages`` stages (nothing built).

    ``starts`` lists the block each stage starts at (default: :func:`even_starts`). Every
    problem raises a ``ValueError``/``TypeError`` naming what was expected and found.

    Example::

        >>> plans = plan_stages(model, PipelineSplit(first=("tok_embeddings",)), 2)  # doctest: +SKIP
        >>> [(p.start, p.stop) for p in plans]  # doctest: +SKIP
        [(0, 1), (1, 2)]
    """
    cls = type(model).__name__
    children = [name for name, _ in model.named_children()]
    missing = [n for n in (split.layers, *split.first, *split.last) if n not in children]
    if missing:
        raise ValueError(
            f"{where}: the split of {cls} names {missing}, which are not children of {cls}; "
            f"its children are {children}"
        )
    layers = getattr(model, split.layers)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{where}: {cls}.{split.layers}: expected a ModuleList of blocks to cut between, "
            f"found {type(layers).__name__}"
        )
    own = [name for name, p in model.named_parameters(recurse=False) if p is not None]
    if own:
        raise ValueError(
            f"{where}: {cls} holds parameters of its own ({own}), which no stage can take; "
            f"expected every parameter inside a child named by the split"
        )
    # init draws children in order: stage order must be the model's order for init to match
    position = {name: i for i, name in enumerate(children)}
    at = position[split.layers]
    out_of_order = [n for n in split.first if position[n] > at] + [
        n for n in split.last if position[n] < at
    ]
    if out_of_order:
        raise ValueError(
            f"{where}: {cls}'s children are registered in the order {children}; expected "
            f"first={split.first} before {split.layers!r} and last={split.last} after it "
            f"(initialisation runs in registration order), found {out_of_order} out of place"
        )
    named = {split.layers, *split.first, *split.last}
    unassigned = [
        name
        for name, child in model.named_children()
        if name not in named and any(True for _ in child.parameters())
    ]
    if unassigned:
        raise ValueError(
            f"{where}: {cls}'s children {unassigned} hold parameters but the split names them in "
            f"neither first={split.first} nor last={split.last}; expected every child with "
            f"parameters to be assigned to a stage"
        )
    n_layers = len(layers)
    if num_stages > n_layers:
        raise ValueError(
            f"{where}: {num_stages} stages need at least {num_stages} layers to cut between; "
            f"{cls}.{split.layers} has {n_layers}"
        )
    if starts is None:
        starts = even_starts(n_layers, num_stages)
    else:
        starts = _check_starts(starts, num_stages, n_layers, where=where)
    stops = [*starts[1:], n_layers]
    shared = tuple(n for n in children if n not in named)  # parameterless: on every stage
    plans = []
    for index, (start, stop) in enumerate(zip(starts, stops, strict=True)):
        held = [*shared, split.layers]
        if index == 0:
            held += split.first
        if index == num_stages - 1:
            held += split.last
        plans.append(
            StagePlan(index, num_stages, start, stop, tuple(n for n in children if n in held))
        )
    return plans


def _check_starts(
    starts: Sequence[int], num_stages: int, n_layers: int, *, where: str
) -> list[int]:
    if isinstance(starts, (str, bytes)) or not isinstance(starts, Sequence):
        raise TypeError(
            f"{where}: split: expected a list of the layer index where each stage starts, "
            f"found {starts!r}"
        )
    values = list(starts)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise TypeError(f"{where}: split: expected int layer indices, found {values!r}")
    if len(values) != num_stages:
        raise ValueError(
            f"{where}: split: expected one start per stage ({num_stages}), found {len(values)} "
            f"in {values}"
        )
    if values[0] != 0:
        raise ValueError(
            f"{where}: split: expected the first stage to start at layer 0, found {values}"
        )
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(
            f"{where}: split: expected strictly increasing starts (each stage holds a layer), "
            f"found {values}"
        )
    if values[-1] >= n_layers:
        raise ValueError(
            f"{where}: split: expected starts in [0, {n_layers}) (the model has {n_layers} "
            f"layers), found {values}"
        )
    return values


def build_stage(model: torch.nn.Module, split: PipelineSplit, plan: StagePlan) -> torch.nn.Module:
    """A copy of ``model`` holding only ``plan``'s parts; the others become :class:`PassThrough`.

    Only this stage's children are copied (on the meta device a copy costs no memory);
    ``model`` itself is left as it was.

    Example::

        >>> stage = build_stage(model, split, plans[1])  # doctest: +SKIP
        >>> [name for name, _ in stage.named_parameters()][0]  # doctest: +SKIP
        'layers.1.attention_norm.weight'
    """
    layers = cast("torch.nn.ModuleList", getattr(model, split.layers))
    memo: dict[int, Any] = {}
    for name, child in model.named_children():
        if name not in plan.children:
            memo[id(child)] = PassThrough(name)
    # one memo for the whole copy, so that states shared between parts stay shared
    blocks = {i: copy.deepcopy(layers[i], memo) for i in range(plan.start, plan.stop)}
    memo[id(layers)] = StageLayers(blocks)
    stage: torch.nn.Module = copy.deepcopy(model, memo)
    return stage
