"""Activation memory measured: the bytes a forward saves for backward, on real or fake tensors.

:class:`SavedTensors` counts the unique storages autograd saves (``saved_tensors_hooks``),
labelled by the block that saved them; :func:`fake_world` runs a forward with no memory
and no compute behind it (torch's ``FakeTensorMode`` over the parameters, torch's fake
process group for the collectives) while the small integer inputs (tokens, targets,
document ids, routing counts) stay real, so that the model's own code (context-parallel
layouts, the mixture of experts' token counts) runs unchanged. The dry run
(:mod:`hyper_parallel.train.dry_run`) measures with both; its test counts a real run
with :class:`SavedTensors` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from hyper_parallel.dmodule.activation_checkpoint import is_checkpointed
from hyper_parallel.dtensor import DTensor, collectives

__all__ = [
    "ActivationCount",
    "SavedTensors",
    "count_activations",
    "fake_world",
    "local_storage_key",
    "parameter_storages",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined,no-any-return]


def local_storage_key(t: torch.Tensor) -> int:
    """The identity of the storage under ``t`` (a DTensor's local shard's)."""
    key: int = _local(t).untyped_storage()._cdata
    return key


@dataclass
class _Saved:
    label: str
    tensor: torch.Tensor  # kept alive: its storage's key is not reused while counted


@dataclass
class SavedTensors:
    """The storages saved for backward inside ``with counter.saving():``, each counted once.

    ``label`` names what is running (a block, the head); a storage counts for the label
    that saved it first. Parameters are not activations: :meth:`bytes_by_label` leaves
    out the storages of ``exclude`` (the parameters' local shards) and storages freed
    since (FSDP's unsharded parameters, resized to 0 after the forward).

    Example::

        >>> counter = SavedTensors()
        >>> x = torch.ones(4, requires_grad=True)
        >>> with counter.saving():
        ...     y = (x * 2).sin()
        >>> counter.bytes_by_label(set())
        {'': 16}
    """

    label: str = ""
    seen: dict[int, _Saved] = field(default_factory=dict)
    #: set while a checkpointed block's forward is replayed to measure its recompute
    replaying: bool = False

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once) for the current label."""
        key = local_storage_key(t)
        if key not in self.seen:
            self.seen[key] = _Saved(self.label, _local(t))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves in this block (a checkpoint's own hooks take over inside it)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def bytes_by_label(self, exclude: set[int]) -> dict[str, int]:
        """Bytes per label, leaving out ``exclude``'s storages and freed ones."""
        totals: dict[str, int] = {}
        for key, saved in self.seen.items():
            if key in exclude:
                continue
            totals[saved.label] = totals.get(saved.label, 0) + _nbytes(saved.tensor)
        return totals

    def largest(self, exclude: set[int], n: int = 3) -> list[tuple[int, str]]:
        """The ``n`` largest saved storages: ``(bytes, "label: shape dtype")``."""
        rows = [
            (_nbytes(s.tensor), f"{s.label}: {list(s.tensor.shape)} {str(s.tensor.dtype)[6:]}")
            for key, s in self.seen.items()
            if key not in exclude
        ]
        return sorted(rows, reverse=True)[:n]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def parameter_storages(modules: list[torch.nn.Module]) -> set[int]:
    """The storage keys of ``modules``' parameters as registered now (sharded or unsharded)."""
    return {local_storage_key(p) for m in modules for p in m.parameters()}


# -- a forward's activations, block by block ------------------------------------------------
@dataclass
class ActivationCount:
    """What one forward saved: per label (``first``, each block's, ``last``) and the rest."""

    by_label: dict[str, int]
    #: per block kind: what recomputing one checkpointed block saves during its backward
    recompute: dict[str, int]
    #: bytes of a block's output (what a pipeline stage sends on)
    boundary: int
    #: bytes of the model's output on this rank (the logits)
    logits: int
    largest: list[tuple[int, str]]
    #: per label: the bytes this rank's forward collectives sent in, by mesh axis
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Everything saved, plus the largest recompute of a checkpointed block."""
        return sum(self.by_label.values()) + max(self.recompute.values(), default=0)


def count_activations(
    model: torch.nn.Module,
    blocks: Sequence[tuple[str, str, torch.nn.Module]],
    run: Callable[[], object],
) -> ActivationCount:
    """Count what ``run()`` (a forward and loss of ``model``) saves for backward, block by block.

    ``blocks`` are ``(label, kind, module)``: what runs before the first block counts as
    ``first``, inside a block for its label, after a block as ``last``. A checkpointed block
    (:func:`~hyper_parallel.dmodule.activation_checkpoint.is_checkpointed`) keeps its inputs
    (and under a selective policy the outputs the policy saves); its recompute in backward
    saves what its plain forward saves, measured once per kind by running that forward
    again. Works on real tensors and inside :func:`fake_world`.

    Example::

        counted = count_activations(model, [("layers.0", "block", model.layers[0])],
                                    lambda: model.loss(tokens, tokens))
    """
    counter = SavedTensors(label="first")
    recompute: dict[str, int] = {}
    boundary = [0]
    logits = [0]
    handles = []
    for label, kind, block in blocks:
        handles.append(
            block.register_forward_pre_hook(
                _block_pre_hook(counter, label, kind, recompute), with_kwargs=True
            )
        )
        handles.append(block.register_forward_hook(_block_post_hook(counter, boundary)))

    def head(module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            logits[0] = _nbytes_local(output)

    handles.append(model.register_forward_hook(head))
    sent: dict[str, dict[str, int]] = {}

    def record(entry: collectives.CollectiveRecord) -> None:
        if counter.replaying:
            return  # the measurement's own replay, not the run's
        axes = sent.setdefault(counter.label, {})
        axes[str(entry.mesh_axis)] = axes.get(str(entry.mesh_axis), 0) + entry.nbytes

    try:
        before = parameter_storages([model])
        with counter.saving(), collectives.observe_collectives(record):
            run()
        exclude = before | parameter_storages([model])
    finally:
        for h in handles:
            h.remove()
    return ActivationCount(
        counter.bytes_by_label(exclude),
        recompute,
        boundary[0],
        logits[0],
        counter.largest(exclude, n=64),
        sent,
    )


def _nbytes_local(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _block_pre_hook(
    counter: SavedTensors, label: str, kind: str, recompute: dict[str, int]
) -> Callable[..., None]:
    def hook(block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        counter.label = label
        if not is_checkpointed(block):
            return
        # a checkpoint keeps its inputs; the rest is recomputed in backward, block by block
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                counter.add(t)
        checkpointed = block.__dict__["forward"]
        policy = checkpointed.policy_fn
        if kind in recompute and policy is None:
            return
        replay = SavedTensors()
        kept = _PolicySaved(policy, counter) if policy is not None else nullcontext()
        counter.replaying = True
        try:
            with torch.enable_grad(), replay.saving(), kept:
                checkpointed._run(*args, **kwargs)  # the block's own forward, no checkpoint
        finally:
            counter.replaying = False
        if kind not in recompute:
            recompute[kind] = sum(replay.bytes_by_label(parameter_storages([block])).values())

    return hook


def _block_post_hook(counter: SavedTensors, boundary: list[int]) -> Callable[..., None]:
    def hook(block: torch.nn.Module, args: object, output: object) -> None:
        counter.label = "last"
        if isinstance(output, torch.Tensor):
            boundary[0] = _nbytes_local(output)

    return hook


class _PolicySaved(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts (into ``counter``) the outputs a selective checkpoint's policy keeps."""

    def __init__(self, policy: Callable[..., CheckpointPolicy], counter: SavedTensors) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.policy = policy
        self.counter = counter
        self.ctx = SelectiveCheckpointContext(is_recompute=False)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        decision = self.policy(self.ctx, func, *args, **kwargs)
        if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.counter.add(t)
        return out


# -- the fake world -------------------------------------------------------------------------
_DATA_DEPENDENT_COUNTS = {torch.ops.aten.bincount.default}
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _balanced_counts(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``bincount`` of routed expert ids whose values are unknown: as many in every bin."""
    source = args[0]
    minlength = int(kwargs.get("minlength", args[2] if len(args) > 2 else 0))
    bins = max(minlength, 1)
    base, extra = divmod(source.numel(), bins)
    with unset_fake_temporarily():
        counts = torch.full((bins,), base, dtype=torch.int64)
        counts[:extra] += 1
    return counts


def _symmetric_collective(func: Any, args: tuple[Any, ...]) -> None:
    """Fill a real tensor's collective output as if every rank held this rank's input.

    torch's fake process group returns at once and writes nothing; real tensors (token
    counts of a mixture of experts, flags) need values: every rank of a dry run's world is
    taken to hold what this one holds.
    """
    name = func.__name__.split(".")[0]
    with unset_fake_temporarily(), torch.no_grad():
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            out, inp = args[0], args[1]
            if isinstance(out, torch.Tensor) and not isinstance(out, FakeTensor):
                out.copy_(inp.reshape(-1).repeat(out.numel() // max(inp.numel(), 1)).view_as(out))
        elif name == "allgather_":
            outs, inps = args[0], args[1]
            for row, inp in zip(outs, inps, strict=False):
                for o in row:
                    if not isinstance(o, FakeTensor):
                        o.copy_(inp)
        elif name == "alltoall_base_":
            out, inp, group = args[0], args[1], args[2]
            if not isinstance(out, FakeTensor) and out.shape == inp.shape and inp.ndim:
                size = dist.get_world_size(_group_of(group))
                me = dist.get_rank(_group_of(group))
                rows = inp.reshape(size, -1)
                out.copy_(rows[me].repeat(size).view_as(out))
        elif name in ("allreduce_",):
            tensors = args[0]
            size = dist.get_world_size(_group_of(args[1]))
            for t in tensors:
                if not isinstance(t, FakeTensor) and not t.dtype.is_floating_point:
                    t.mul_(size)  # a sum of equal values (flags, counts)


def _group_of(group: Any) -> Any:
    return group if isinstance(group, dist.ProcessGroup) else None


class _RealIntegers(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Under FakeTensorMode: real ops on real tensors; integer factories real; fake otherwise."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.fake = fake

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(type(t) not in (torch.Tensor, FakeTensor, torch.nn.Parameter) for t in tensors):
            return NotImplemented  # a subclass (DTensor): it dispatches its local ops again
        fake = any(isinstance(t, FakeTensor) for t in tensors)
        if func in _DATA_DEPENDENT_COUNTS and fake:
            return _balanced_counts(func, args, kwargs)
        if func.namespace == "c10d":
            out = func(*args, **kwargs)
            _symmetric_collective(func, args)
            return out
        # meta tensors (a model built on the meta device) become fake, never real memory
        real = bool(tensors) and not fake and not any(t.is_meta for t in tensors)
        if not tensors:
            dtype = kwargs.get("dtype")
            real = dtype in _INDEX_DTYPES or (
                dtype is None and func.__name__.split(".")[0] in ("arange", "scalar_tensor")
            )
        if real:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def fake_world() -> Iterator[FakeTensorMode]:
    """Allocate nothing: floating-point tensors made inside are fake, integer inputs stay real.

    Example::

        >>> with fake_world():
        ...     x = torch.empty(2**40)  # a terabyte, never allocated
        >>> x.shape[0] == 2**40
        True
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _RealIntegers(mode):
        yield mode


def nbytes_of(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize
