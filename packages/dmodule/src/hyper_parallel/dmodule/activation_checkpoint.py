"""Activation checkpointing over torch's own: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Nothing here re-implements checkpointing. :func:`checkpoint` is upstream hyper-parallel's
name for torch's non-reentrant checkpoint (``policy_fn`` turns on torch's op-level
selective checkpointing, ``create_selective_checkpoint_contexts``);
:func:`apply_activation_checkpointing` checkpoints whole blocks, ``mode="full"``
(recompute everything) or ``mode="selective"`` (keep what :func:`save_matmuls` keeps).

It works on hp DTensors and inside ``local_map`` regions as on plain tensors: torch's
checkpoint sees the ops (a DTensor op is one op to it, its collectives included), and
replays the CPU and device generators' states in the recompute, so dropout draws the
same mask (hp-dtensor's random ops on DTensors read torch's generators). Gradients are
bitwise those of the same model without checkpointing.

A checkpointed block's ``forward`` is replaced on the instance; its hooks (a sharded
data-parallel pre-forward unshard, for example) stay outside the checkpoint, so the
recompute in backward runs the forward alone, not the hooks. Parameter names do not
change (no wrapper module).

Example::

    from hyper_parallel.dmodule.activation_checkpoint import apply_activation_checkpointing

    model.parallelize(mesh)                                  # TP first
    apply_activation_checkpointing(model.layers, mode="selective")
    model.loss(tokens, targets).backward()                   # same gradients, less memory
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as torch_checkpoint,
)

__all__ = [
    "MODES",
    "CheckpointPolicy",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_mode",
    "is_checkpointed",
    "save_matmuls",
]

T = TypeVar("T")
Mode = Literal["none", "full", "selective"]
#: The modes :func:`apply_activation_checkpointing` takes.
MODES: tuple[str, ...] = ("none", "full", "selective")
PolicyFn = Callable[..., CheckpointPolicy]
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

aten = torch.ops.aten

# The ops whose outputs selective checkpointing keeps: the matmuls and attention (the
# FLOPs of a transformer block); everything else (norms, activations, rotary, views,
# dropout) is recomputed. The list is read where a policy is built, so absent ops
# (another torch version) are skipped, not an error.
_MATMUL_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


@functools.cache
def _matmul_ops() -> frozenset[Any]:
    ops = set()
    for name in _MATMUL_OP_NAMES:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``mode="selective"`` policy: keep matmul and attention outputs, recompute the rest.

    A ``policy_fn`` as torch's ``create_selective_checkpoint_contexts`` takes it:
    ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``.

    Example::

        >>> save_matmuls(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.MUST_SAVE: 0>
        >>> save_matmuls(None, torch.ops.aten.mul.Tensor)
        <CheckpointPolicy.PREFER_RECOMPUTE: 3>
    """
    del ctx, args, kwargs
    if op in _matmul_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy_fn: PolicyFn | None) -> ContextFn | None:
    if policy_fn is None:
        return None
    if not callable(policy_fn):
        raise TypeError(
            "checkpoint: expected policy_fn to be a callable (ctx, op, *args, **kwargs) -> "
            f"CheckpointPolicy, found {type(policy_fn).__name__}"
        )
    return functools.partial(create_selective_checkpoint_contexts, policy_fn)


def checkpoint(
    function: Callable[..., T],
    *args: Any,
    policy_fn: PolicyFn | None = None,
    **kwargs: Any,
) -> T:
    """``function(*args, **kwargs)`` with its activations recomputed in backward (upstream's name).

    torch's ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
    **kwargs)``; ``policy_fn`` (torch's selective-checkpoint policy, e.g.
    :func:`save_matmuls`) chooses per op what is kept instead of recomputed. Torch's
    own keywords (``preserve_rng_state``, ``determinism_check``, ``debug``,
    ``context_fn``) pass through; ``use_reentrant=True`` is refused (the reentrant
    variant drops gradients of inputs that do not require grad and cannot take a policy).

    Example::

        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> y = checkpoint(lambda t: torch.relu(layer(t)), x, policy_fn=save_matmuls)
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    if kwargs.get("use_reentrant", False):
        raise ValueError(
            "checkpoint: use_reentrant=True is not supported; hyper-parallel checkpoints with "
            "torch's non-reentrant implementation (use_reentrant=False)"
        )
    kwargs.pop("use_reentrant", None)
    context_fn = _context_fn(policy_fn)
    if context_fn is not None:
        if "context_fn" in kwargs:
            raise ValueError("checkpoint: pass policy_fn or context_fn, not both")
        kwargs["context_fn"] = context_fn
    return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


class _CheckpointedForward:
    """A block's ``forward`` run under :func:`checkpoint`.

    A plain object (not a closure), so the module still deep-copies with its copy's
    forward bound to the copy. The inner forward is the instance's own ``forward``
    attribute when it had one, else the class's, looked up at call time (a later
    class swap, as ``Module.parallelize`` makes, is followed).
    """

    def __init__(
        self, module: nn.Module, inner: Callable[..., Any] | None, policy_fn: PolicyFn | None
    ) -> None:
        self.module = module
        self.inner = inner
        self.policy_fn = policy_fn

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the forward's keywords are bound first: none can be taken for one of checkpoint's
        run = functools.partial(self._run, **kwargs) if kwargs else self._run
        return checkpoint(run, *args, policy_fn=self.policy_fn)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` made ``module``'s forward checkpointed.

    Example::

        >>> is_checkpointed(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(
    blocks: nn.Module | Iterable[nn.Module],
    *,
    mode: str = "full",
    policy_fn: PolicyFn | None = None,
) -> None:
    """Checkpoint every block's forward in place (TorchTitan's per-block activation checkpointing).

    ``blocks``: one module or several (a ``ModuleList`` of transformer blocks is taken
    as its children). ``mode``: ``"full"`` keeps only each block's inputs and recomputes
    the rest in backward; ``"selective"`` also keeps the outputs of the ops ``policy_fn``
    says to save (default :func:`save_matmuls`: matmuls and attention), recomputing
    pointwise ops and norms; ``"none"`` changes nothing. Apply it after tensor
    parallelism, before compiling and sharded data parallelism. Every block is checked
    before any is changed.

    Example::

        >>> blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        >>> apply_activation_checkpointing(blocks, mode="selective")
        >>> all(is_checkpointed(b) for b in blocks)
        True
    """
    if mode not in MODES:
        raise ValueError(
            f"apply_activation_checkpointing: expected mode to be one of {MODES}, found {mode!r}"
        )
    if policy_fn is not None and mode != "selective":
        raise ValueError(
            f"apply_activation_checkpointing: policy_fn is for mode='selective', found mode={mode!r}"
        )
    if isinstance(blocks, nn.ModuleList):
        targets = list(blocks)
    elif isinstance(blocks, nn.Module):
        targets = [blocks]
    else:
        targets = list(blocks)
    for index, block in enumerate(targets):
        if not isinstance(block, nn.Module):
            raise TypeError(
                f"apply_activation_checkpointing: block {index}: expected an nn.Module, found "
                f"{type(block).__name__}"
            )
        if is_checkpointed(block):
            raise ValueError(
                f"apply_activation_checkpointing: block {index} ({type(block).__name__}) is "
                "already checkpointed"
            )
    if mode == "none":
        return
    policy = (policy_fn or save_matmuls) if mode == "selective" else None
    for block in targets:
        inner = block.__dict__.get("forward")
        block.forward = _CheckpointedForward(block, inner, policy)  # type: ignore[method-assign]


def checkpoint_mode(job_config: object) -> str:
    """The activation-checkpointing mode a job config asks for (``"none"`` when it names none).

    Read from ``job_config.activation_checkpoint`` (or the key of a mapping): a mode
    string, or an object/mapping with a ``mode`` (TorchTitan's
    ``activation_checkpoint.mode``).

    Example::

        >>> checkpoint_mode({"activation_checkpoint": {"mode": "selective"}})
        'selective'
        >>> checkpoint_mode(None)
        'none'
    """
    section: object
    if isinstance(job_config, Mapping):
        section = job_config.get("activation_checkpoint")
    else:
        section = getattr(job_config, "activation_checkpoint", None)
    if isinstance(section, Mapping):
        section = section.get("mode")
    elif section is not None and not isinstance(section, str):
        section = getattr(section, "mode", None)
    if section is None:
        return "none"
    if section not in MODES:
        raise ValueError(f"activation_checkpoint.mode: expected one of {MODES}, found {section!r}")
    return cast(str, section)
