"""Model and optimizer state dicts of parallelized models: torch's DCP helpers, hp DTensors included.

``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` work
for hp models as they are for sharded state dicts (FQN-keyed; optimizer states are
DTensors laid out like their parameters). Their ``full_state_dict`` and
``cpu_offload`` options test for torch's own DTensor class, so hp DTensors would
pass through them un-gathered; the functions here have the same signatures and
add that part.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)
from torch.distributed.checkpoint.state_dict import (
    get_state_dict as torch_get_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    set_state_dict as torch_set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    collectives,
    distribute_tensor,
    init_device_mesh,
)
from hyper_parallel.platform import get_platform

__all__ = ["ModelState", "StateDictOptions", "get_state_dict", "set_state_dict"]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_state_dict(
    model: torch.nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[torch.nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)``, FQN-keyed, as torch's ``get_state_dict``.

    Sharded by default: parameters and optimizer states are DTensors laid out like
    the parameters. ``options.full_state_dict`` gathers every DTensor into a full
    tensor (a collective: all ranks call it); with ``cpu_offload`` too, only rank 0
    gets the values (other ranks get empty dicts), as torch.

    Example::

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step-10")
    """
    options = options or StateDictOptions()
    sharded = dataclasses.replace(options, full_state_dict=False, cpu_offload=False)
    model_sd, optim_sd = torch_get_state_dict(
        model, optimizers, submodules=submodules, options=sharded
    )
    model_sd = _finish_get(model_sd, options)
    optim_sd = _finish_get(optim_sd, options)  # type: ignore[arg-type]
    return model_sd, optim_sd  # type: ignore[return-value]


def set_state_dict(
    model: torch.nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    """Load state dicts from :func:`get_state_dict` (sharded or full) into a model and optimizers.

    Plain full tensors (a ``full_state_dict``, or one saved by an unparallelized
    model) are laid out like the model's parameters first: each rank keeps its
    slice, with no communication. With ``broadcast_from_rank0`` (and
    ``full_state_dict``) only rank 0 needs the state dicts (the others may pass
    ``{}``): rank 0's are broadcast to every rank (through
    ``hyper_parallel.dtensor.collectives``; each rank holds the full dicts while it
    slices them), as for torch's FSDP models. Returns torch's missing/unexpected keys.

    Example::

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    options = options or StateDictOptions()
    if options.broadcast_from_rank0:
        if not options.full_state_dict:
            raise ValueError(
                "set_state_dict: broadcast_from_rank0=True needs full_state_dict=True (as torch)"
            )
        model_state_dict, optim_state_dict = _from_rank0(
            model, (model_state_dict, optim_state_dict)
        )
    params = dict(model.named_parameters())
    current = model.state_dict()
    model_state_dict = {
        k: _like(v, current.get(k), f"model_state_dict[{k!r}]") for k, v in model_state_dict.items()
    }
    if "state" in optim_state_dict:
        optim_state_dict = dict(optim_state_dict)
        optim_state_dict["state"] = {
            fqn: _optimizer_state_like(fqn, states, params.get(fqn))
            for fqn, states in optim_state_dict["state"].items()
        }
    sharded = dataclasses.replace(
        options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
    )
    return torch_set_state_dict(
        model,
        optimizers,
        model_state_dict=model_state_dict,
        optim_state_dict=optim_state_dict,  # type: ignore[arg-type]
        options=sharded,
    )


class ModelState(Stateful):
    """A model and its optimizers as one DCP ``Stateful``: ``{"model": ..., "optim": ...}``.

    ``state_dict()`` is :func:`get_state_dict` (sharded); ``load_state_dict`` is
    :func:`set_state_dict`. Give it to ``dcp.save``/``dcp.load`` or
    :func:`hyper_parallel.dmodule.checkpoint.save`.

    Example::

        dcp.save({"app": ModelState(model, optimizer)}, checkpoint_id="ckpt/step-10")
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Optimizers = (),
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizers = (
            [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        )
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_sd, "optim": optim_sd} if self.optimizers else {"model": model_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
            options=self.options,
        )


_world_meshes: dict[str, DeviceMesh] = {}


def _from_rank0(model: torch.nn.Module, dicts: tuple[Any, Any]) -> Any:
    """Rank 0's ``dicts`` on every rank: pickled bytes, broadcast over a world mesh."""
    device_type = "cpu"
    for p in model.parameters():
        if isinstance(p, DTensor):
            device_type = p.device_mesh.device_type
            break
    platform = get_platform()
    mesh = _world_meshes.get(device_type)
    if mesh is None:
        mesh = _world_meshes[device_type] = init_device_mesh(
            device_type, (platform.get_world_size(),)
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    payload = torch.empty(0, dtype=torch.uint8, device=device)
    if platform.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(_map_tensors(dicts, lambda t: t.detach().cpu()), buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    size = collectives.broadcast(size, mesh, 0, 0)
    if platform.get_rank() != 0:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    payload = collectives.broadcast(payload, mesh, 0, 0)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj


def _finish_get(state: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    if options.full_state_dict:
        state = _map_tensors(state, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    if options.cpu_offload:
        state = _map_tensors(state, lambda t: t.cpu())
        if options.full_state_dict and get_platform().get_rank() != 0:
            return {}
    return state


def _like(value: Any, current: Any, where: str) -> Any:
    """``value`` laid out like ``current`` when it is a plain full tensor and ``current`` a DTensor."""
    if not isinstance(current, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(
            f"set_state_dict: {where} has shape {tuple(value.shape)}; the model's is "
            f"{tuple(current.shape)}"
        )
    full = value.to(dtype=current.dtype, device=current.device)
    return distribute_tensor(full, current.device_mesh, current.placements, src_data_rank=None)


def _optimizer_state_like(fqn: str, states: Any, param: torch.Tensor | None) -> Any:
    """Per-parameter optimizer states shaped like the parameter are laid out like it."""
    if not isinstance(states, dict) or param is None:
        return states
    return {
        k: _like(v, param, f"optim_state_dict['state'][{fqn!r}][{k!r}]")
        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape)
        else v
        for k, v in states.items()
    }
