"""``checkpoint.export_hf``: the trained model as a Hugging Face directory, pipeline stages gathered."""

from __future__ import annotations

import torch

from hyper_parallel.dmodule.checkpoint import save_hf
from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives
from hyper_parallel.platform import get_platform

__all__ = ["export_hf"]


def export_hf(
    model: torch.nn.Module,
    parts: list[torch.nn.Module],
    pp_mesh: DeviceMesh | None,
    device: torch.device,
    directory: str,
) -> None:
    """Write the trained model to ``directory`` (collective; rank 0 writes).

    ``model`` is the whole model: the trained one, or under a pipeline (``pp_mesh``) the
    one built on the meta device, which this rank's stages ``parts`` fill on rank 0.

    Example::

        export_hf(built.model, built.parts, None, device, "out/hf")
    """
    if pp_mesh is None:
        save_hf(model, directory)
        return
    rank = get_platform().get_rank()
    save_hf(_gather_stages(model, parts, pp_mesh, rank, device), directory)


def _gather_stages(
    whole: torch.nn.Module,
    parts: list[torch.nn.Module],
    pp_mesh: DeviceMesh,
    rank: int,
    device: torch.device,
) -> torch.nn.Module:
    """``whole`` (the model built on the meta device) holding every stage's states on rank 0.

    Collective over every rank. State by state in ``whole``'s order, the stage that holds
    it gathers it whole (``full_tensor`` over its own mesh) and its ``pp`` rank broadcasts
    it over ``pp``; rank 0 alone allocates ``whole`` (on the CPU) and keeps the values.
    The other ranks return ``whole`` still on the meta device: :func:`save_hf` reads
    values on rank 0 only.
    """
    held: dict[str, torch.Tensor] = {}
    for part in parts:
        held.update(part.state_dict())
    names = list(whole.state_dict())
    me = pp_mesh.get_local_rank("pp")
    owners = torch.tensor([me if n in held else -1 for n in names], device=device)
    owners = collectives.all_reduce(owners, pp_mesh, "pp", "max")
    if rank == 0:
        whole.to_empty(device="cpu")
    values = whole.state_dict()
    for name, owner in zip(names, owners.tolist(), strict=True):
        if owner < 0:
            raise ValueError(
                f"checkpoint.export_hf: expected a pipeline stage holding {name!r}, found none"
            )
        mine = held.get(name)
        if isinstance(mine, DTensor):
            mine = mine.full_tensor()  # every rank of the owning stage, in the same order
        shape, dtype = values[name].shape, values[name].dtype
        sent = (
            mine.detach().contiguous()
            if mine is not None
            else torch.empty(shape, dtype=dtype, device=device)
        )
        got = collectives.broadcast(sent, pp_mesh, "pp", int(owner))
        if rank == 0:
            values[name].copy_(got)
    return whole
