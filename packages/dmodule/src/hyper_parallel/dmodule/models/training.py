"""The training step every loop here uses (the demo, hp-train, the bench), synthetic data, dp averaging."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hyper_parallel.dmodule.pipeline import Pipeline, stage_owner
from hyper_parallel.dtensor import DeviceMesh, DTensor, clip_grad_norm_, collectives
from hyper_parallel.dtensor.fsdp import FSDPModule

__all__ = ["StepResult", "average_gradients", "eval_loss", "synthetic_batch", "train_step"]


def synthetic_batch(
    step: int, *, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of shape ``(batch_size, seq_len)`` for ``step``, from a seeded generator.

    Each row follows the rule ``next = (3 * token + 1) % vocab_size`` from a random
    start, with one token in eight replaced by noise, so a model can learn it. The
    targets are the tokens shifted by one; the same ``(step, seed)`` gives the same
    batch in every process.

    Example::

        >>> tokens, targets = synthetic_batch(0, batch_size=2, seq_len=4, vocab_size=10)
        >>> bool((tokens[:, 1:] == targets[:, :-1]).all())
        True
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    stream = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    stream[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    for position in range(1, seq_len + 1):
        stream[:, position] = (3 * stream[:, position - 1] + 1) % vocab_size
    noise = torch.rand(batch_size, seq_len + 1, generator=generator) < 0.125
    random_tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    stream = torch.where(noise, random_tokens, stream)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def average_gradients(model: torch.nn.Module, mesh: DeviceMesh, axis: str = "dp") -> None:
    """Average every gradient over mesh axis ``axis`` (data parallel), in place of ``.grad``.

    DTensor gradients (on the ``tp`` submesh) are averaged shard by shard: the ranks
    along ``axis`` hold the same shard of different data's gradients.

    Example::

        >>> loss.backward(); average_gradients(model, mesh, "dp"); optimizer.step()  # doctest: +SKIP
    """
    fsdp = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    ]
    if fsdp:
        raise ValueError(
            f"average_gradients: {fsdp[0]!r} is fully sharded (fully_shard); FSDP already averages "
            "its gradients over its data-parallel mesh: use one data-parallel scheme per model"
        )
    if mesh.size(axis) == 1:
        return
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            reduced = collectives.all_reduce(grad.to_local(), mesh, axis, "avg")
            param.grad = DTensor.from_local(
                reduced, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
            )
        else:
            param.grad = collectives.all_reduce(grad, mesh, axis, "avg")


@dataclass
class StepResult:
    """What :func:`train_step` measured: the loss (averaged over microbatches and the loss
    axes; the same on every rank), the gradients' total norm before clipping (None without
    clipping), and whether the optimizer stepped (False: a non-finite loss was skipped)."""

    loss: float
    grad_norm: float | None
    stepped: bool


def train_step(
    model: torch.nn.Module | Pipeline,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    optimizer: torch.optim.Optimizer,
    *,
    loss_mesh: DeviceMesh | None = None,
    loss_axes: tuple[str, ...] = (),
    pp_mesh: DeviceMesh | None = None,
    average_over: tuple[DeviceMesh, str] | None = None,
    max_norm: float | None = None,
    skip_nonfinite: bool = False,
    step: int = 0,
    autocast_dtype: torch.dtype | None = None,
) -> StepResult:
    """One optimizer step of any layout: forward and backward, gradient sync, clipping, update.

    ``model`` is a module with ``loss(tokens, targets[, document_ids])`` whose microbatch
    losses are averaged (gradient accumulation: each backward is scaled by
    ``1 / len(microbatches)``), or a :class:`~hyper_parallel.dmodule.pipeline.Pipeline`
    that runs the microbatches as one schedule step (the whole batch's token mean; each
    stage gets the microbatches' ``document_ids`` when its forward takes them). The
    loss reported is averaged over ``loss_axes`` of ``loss_mesh`` (the data-parallel ranks;
    with a pipeline the last stage's loss is first broadcast over ``pp_mesh``, axis ``pp``;
    without ``pp_mesh`` a rank without the last stage reports 0).
    ``average_over=(mesh, axis)`` averages gradients over that data-parallel axis (plain
    replicas; fully sharded modules average their own). ``max_norm`` clips the total norm
    across every mesh (:func:`~hyper_parallel.dtensor.clip_grad_norm_`). A loss that is not
    finite raises ``FloatingPointError`` naming ``step``, or, with ``skip_nonfinite``, skips
    the update. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs each microbatch's forward
    under ``torch.autocast`` (mixed precision without FSDP, as TorchTitan; the backward runs
    outside it). The caller steps its LR scheduler.

    Example::

        result = train_step(model, [(tokens, targets)], optimizer, max_norm=1.0, step=1)
    """
    _check_autocast(model, autocast_dtype, "train_step")
    if isinstance(model, Pipeline):
        parts = list(model.model_parts)
        local = _pipeline_forward_backward(model, microbatches, pp_mesh)
    else:
        parts = [model]
        local = _forward_backward(model, microbatches, autocast_dtype=autocast_dtype)
    if average_over is not None:
        for part in parts:
            average_gradients(part, *average_over)
    parameters = [p for part in parts for p in part.parameters()]
    loss = local.detach().reshape(1)
    if loss_mesh is not None and loss_axes:
        loss = collectives.all_reduce_over(loss, loss_mesh, loss_axes, "avg")
    value = float(loss.item())
    norm = None
    if max_norm is not None and isinstance(model, Pipeline) and pp_mesh is not None:
        norm = _clip_across_stages(parameters, max_norm, pp_mesh)
    elif max_norm is not None:
        norm = float(clip_grad_norm_(parameters, max_norm))
    if not math.isfinite(value) or (norm is not None and not math.isfinite(norm)):
        if not skip_nonfinite:
            optimizer.zero_grad()
            raise FloatingPointError(
                f"step {step}: the loss is {value} (gradient norm {norm}); stopping (set "
                "training.skip_nonfinite = true to skip such steps)"
            )
        optimizer.zero_grad()
        return StepResult(value, norm, stepped=False)
    optimizer.step()
    optimizer.zero_grad()
    return StepResult(value, norm, stepped=True)


def eval_loss(
    model: torch.nn.Module | Pipeline,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    *,
    pp_mesh: DeviceMesh | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's mean loss of ``microbatches``, forward only (validation): no gradient, eval mode.

    The same forward as :func:`train_step`'s (``document_ids`` reach a module's ``loss``
    when it takes them; a :class:`~hyper_parallel.dmodule.pipeline.Pipeline` runs the
    microbatches through :meth:`Pipeline.eval` (torch's ``schedule.eval``), and the last
    stage's loss is broadcast over ``pp_mesh``), without backward and with every module in
    eval mode for the call (``autocast_dtype`` as in :func:`train_step`). Returns a
    one-element tensor, not averaged over data-parallel ranks (the caller reduces it as
    :func:`train_step` reduces the training loss).

    Example::

        val = eval_loss(model, [(tokens, targets)])
    """
    _check_autocast(model, autocast_dtype, "eval_loss")
    parts = list(model.model_parts) if isinstance(model, Pipeline) else [model]
    modes = [(m, m.training) for part in parts for m in part.modules()]
    for part in parts:
        part.eval()
    try:
        with torch.no_grad():
            if isinstance(model, Pipeline):
                return _pipeline_forward_backward(model, microbatches, pp_mesh, backward=False)
            return _forward_backward(
                model, microbatches, backward=False, autocast_dtype=autocast_dtype
            ).reshape(1)
    finally:
        for module, mode in modes:
            module.training = mode


def _check_autocast(
    model: torch.nn.Module | Pipeline, autocast_dtype: torch.dtype | None, where: str
) -> None:
    if autocast_dtype is not None and isinstance(model, Pipeline):
        raise ValueError(
            f"{where}: autocast_dtype: expected None with a Pipeline (its stages' forwards run "
            f"inside torch's schedule), found {autocast_dtype}"
        )


def _clip_across_stages(
    parameters: Sequence[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh
) -> float:
    """Clip to the norm of every stage's gradients: each rank holds only its stages' ones."""
    mine = clip_grad_norm_(parameters, math.inf)  # this rank's norm (over its meshes); no clip
    squares = collectives.all_reduce(mine.reshape(1) ** 2, pp_mesh, "pp", "sum")
    total: float = float(squares.item()) ** 0.5
    coefficient = min(1.0, max_norm / (total + 1e-6))  # clip_grad_norm_'s rule
    if coefficient < 1.0:
        with torch.no_grad():
            for param in parameters:
                if param.grad is not None:
                    param.grad.mul_(coefficient)
    return float(total)


def _forward_backward(
    model: torch.nn.Module,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    *,
    backward: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    loss_fn: Callable[..., torch.Tensor] = model.loss  # type: ignore[assignment]
    takes_documents = _takes_documents(loss_fn)
    total: torch.Tensor | None = None
    for tokens, targets, *rest in microbatches:
        kwargs = {"document_ids": rest[0]} if rest and takes_documents else {}
        if autocast_dtype is None:
            loss = loss_fn(tokens, targets, **kwargs)
        else:
            with torch.autocast(tokens.device.type, dtype=autocast_dtype):
                loss = loss_fn(tokens, targets, **kwargs)
        if len(microbatches) > 1:
            loss = loss / len(microbatches)
        if backward:
            loss.backward()  # type: ignore[no-untyped-call]
        value = loss.detach()
        # a replicated DTensor loss holds the whole value: read it as a plain tensor
        value = value.full_tensor() if isinstance(value, DTensor) else value
        total = value if total is None else total + value
    if total is None:
        raise ValueError("train_step: expected at least one microbatch, found none")
    return total


def _takes_documents(fn: Callable[..., object]) -> bool:
    return "document_ids" in inspect.signature(fn).parameters


def _pipeline_forward_backward(
    pipe: Pipeline,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    pp_mesh: DeviceMesh | None,
    *,
    backward: bool = True,
) -> torch.Tensor:
    tokens = torch.cat([batch[0] for batch in microbatches])
    targets = torch.cat([batch[1] for batch in microbatches])
    inputs: dict[str, torch.Tensor] = {}
    forward = pipe.model_parts[0].forward
    if all(len(b) > 2 for b in microbatches) and _takes_documents(forward):
        # every stage's attention needs the documents (pipeline stages take the whole batch's)
        inputs["document_ids"] = torch.cat([batch[2] for batch in microbatches])
    run = pipe.step if backward else pipe.eval
    loss = run(tokens, target=targets, **inputs)
    mine = loss if loss is not None else torch.zeros((), device=tokens.device)
    if pp_mesh is None:
        return mine.detach()
    last = stage_owner(pipe.num_stages - 1, pp_mesh.size("pp"), pipe.schedule_name)
    return collectives.broadcast(mine.detach().reshape(1), pp_mesh, "pp", last)
