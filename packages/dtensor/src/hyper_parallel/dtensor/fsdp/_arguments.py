"""``fully_shard``'s argument checks: mesh, device, resharding, managed parameters, shard dims."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, _entered, _live_meshes, init_device_mesh
from hyper_parallel.dtensor.fsdp._param_group import MeshInfo, Slot
from hyper_parallel.dtensor.fsdp._state import _state_of
from hyper_parallel.dtensor.placement_types import Shard

# Parameters fully_shard replaced (by id, with a weak reference to tell a reused id): an
# optimizer still holding one was built too early.
_replaced_params: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
_default_mesh: DeviceMesh | None = None

ShardPlacementFn = Callable[[nn.Parameter], Shard | None]


def _mesh_or_default(device: torch.device | str | None) -> DeviceMesh:
    """The entered mesh, else (as torch) a 1-D mesh over the world, built once."""
    global _default_mesh
    stack = _entered.get()
    if stack:
        return stack[-1]
    if _default_mesh is None:
        kind = torch.device(device).type if device is not None else "cpu"
        if device is None and torch.cuda.is_available():
            kind = "cuda"
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        _default_mesh = init_device_mesh(kind, (world,))
    return _default_mesh


def _mesh_info(mesh: DeviceMesh, where: str) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: expected a hyper_parallel.dtensor.DeviceMesh, found {type(mesh).__name__}"
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh, 0, None)
    if mesh.ndim == 2:
        return MeshInfo(mesh, 1, 0)
    raise ValueError(
        f"{where}: expected a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), found "
        f"{mesh.ndim}-D mesh {mesh.mesh_dim_names or mesh.shape}"
    )


def _device_of(mesh: DeviceMesh, device: torch.device | str | None, where: str) -> torch.device:
    if mesh.device_type == "cpu":
        dev = torch.device("cpu")
    else:
        module = getattr(torch, mesh.device_type)
        dev = torch.device(mesh.device_type, module.current_device())
    if device is not None and torch.device(device).type != dev.type:
        raise ValueError(
            f"{where}: device={device!r} is not the mesh's device type {mesh.device_type!r}"
        )
    return dev


def _check_reshard_after_forward(value: bool | int | None, info: MeshInfo, where: str) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            f"{where}: reshard_after_forward should be None, a bool or an int, found {value!r}"
        )
    size = info.shard_size
    axis = info.axis_name(info.shard_axis) or info.shard_axis
    if value < 1 or value > size or size % value:
        raise ValueError(
            f"{where}: reshard_after_forward={value} must be a factor of the shard size {size} "
            f"(mesh axis {axis!r})"
        )
    if value == 1:
        return False
    if value == size:
        return True
    raise NotImplementedError(
        f"{where}: reshard_after_forward={value} (resharding to a smaller group than mesh axis "
        f"{axis!r} of size {size}) is not supported; pass True, False or {size}"
    )


def _managed_params(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter], where: str
) -> dict[nn.Parameter, list[Slot]]:
    """Each parameter this call manages and where it is registered (shared ones once)."""
    known: set[int] = set()
    for m in modules:
        for p in m.parameters():
            known.add(id(p))
    missing = [p for p in ignored if id(p) not in known]
    if missing:
        raise ValueError(
            f"{where}: ignored_params holds {len(missing)} parameter(s) of shape(s) "
            f"{[tuple(p.shape) for p in missing]} that are not in the module(s)"
        )
    slots: dict[nn.Parameter, list[Slot]] = {}
    elsewhere: dict[int, tuple[str, str]] = {}  # params of nested FSDP modules, by id
    visited: set[int] = set()

    def walk(m: nn.Module, prefix: str, top: bool) -> None:
        if id(m) in visited:
            return
        visited.add(id(m))
        state = _state_of(m)
        if state is not None and not top:
            for fp in state.group.params:
                elsewhere[id(fp.sharded_param)] = (prefix or type(m).__name__, fp.fqn)
            return
        for name, param in m._parameters.items():
            if param is None or param in ignored:
                continue
            slots.setdefault(param, []).append(Slot(m, name))
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name, False)

    for m in modules:
        walk(m, "", True)
    for p, where_list in slots.items():
        if id(p) in elsewhere:
            owner, fqn = elsewhere[id(p)]
            raise ValueError(
                f"{where}: parameter {where_list[0].name!r} of {type(where_list[0].module).__name__} "
                f"is also parameter {fqn!r} of FSDP module {owner!r}; a parameter shared by two "
                "modules must go in one fully_shard([a, b]) call"
            )
    # a parameter an earlier fully_shard replaced, still registered here: it was shared
    for p, where_list in slots.items():
        replaced_in = _replaced_by_fully_shard(p)
        if replaced_in is not None:
            raise ValueError(
                f"{where}: parameter {where_list[0].name!r} of {type(where_list[0].module).__name__} "
                f"is shared with {replaced_in}, which already sharded it; a parameter shared by two "
                "modules must go in one fully_shard([a, b]) call"
            )
    # a nested FSDP module's sharded parameter reached through another path is shared too
    for m in modules:
        for name, sub in m.named_modules():
            if _state_of(sub) is None or sub is m:
                continue
            for p in slots:
                for sp in sub._hp_fsdp_state.group.params:  # type: ignore[union-attr]
                    if sp.sharded_param is p:
                        raise ValueError(
                            f"{where}: parameter {sp.fqn!r} is shared by FSDP module {name!r} "
                            "and this call; a parameter shared by two modules must go in one "
                            "fully_shard([a, b]) call"
                        )
    for p, where_list in slots.items():
        if isinstance(p, DTensor) and p.device_mesh.ndim > 2:
            raise ValueError(
                f"{where}: parameter {where_list[0].name!r} of {type(where_list[0].module).__name__} "
                f"is a DTensor on a {p.device_mesh.ndim}-D mesh; fully_shard composes with a 1-D "
                "(TP or EP) or 2-D (EP x TP) mesh, as torch"
            )
        if isinstance(p, DTensor) and _cut_twice(p):
            raise ValueError(
                f"{where}: parameter {where_list[0].name!r} of {type(where_list[0].module).__name__} "
                f"has placements {p.placements} on mesh {p.device_mesh.mesh_dim_names}: two "
                "axes split the same dim; expected each dim split by one axis at most"
            )
        if isinstance(p, DTensor) and any(q.is_partial() for q in p.placements):
            raise ValueError(
                f"{where}: parameter {where_list[0].name!r} of {type(where_list[0].module).__name__} "
                f"has placements {p.placements}; expected Shard or Replicate"
            )
    return slots


def _cut_twice(p: DTensor) -> bool:
    """Whether two mesh axes of more than one rank shard the same dim of ``p``."""
    dims = [
        q.dim
        for i, q in enumerate(p.placements)
        if isinstance(q, Shard) and p.device_mesh.size(i) > 1
    ]
    return len(dims) != len(set(dims))


def _fqn(modules: tuple[nn.Module, ...], slot: Slot) -> str:
    for m in modules:
        for name, sub in m.named_modules():
            if sub is slot.module:
                return f"{name}.{slot.name}" if name else slot.name
    return slot.name


def _shard_dim(
    param: nn.Parameter,
    fn: ShardPlacementFn | None,
    info: MeshInfo,
    fqn: str,
    where: str,
) -> int:
    placement = fn(param) if fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"{where}: shard_placement_fn returned {placement!r} for {fqn!r}; expected a Shard or None"
        )
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < max(param.ndim, 1):
        raise ValueError(
            f"{where}: shard_placement_fn gave {placement!r} for {fqn!r} of {param.ndim} dim(s)"
        )
    if dim != 0:
        local = param._local_tensor if isinstance(param, DTensor) else param  # type: ignore[attr-defined]
        if local.shape[dim] % info.shard_size:
            raise ValueError(
                f"{where}: {fqn!r} sharded on dim {dim} needs its size {local.shape[dim]} to be "
                f"divisible by the shard size {info.shard_size} (as torch)"
            )
    return dim


def _joint_finder(
    info: MeshInfo, param: nn.Parameter, where: str, fqn: str
) -> Callable[[tuple[str, ...]], DeviceMesh]:
    """Find the named mesh whose slices are the dp mesh and ``param``'s TP mesh."""

    def find(names: tuple[str, ...]) -> DeviceMesh:
        assert isinstance(param, DTensor)
        tp_mesh = param.device_mesh
        dp_names = info.mesh.mesh_dim_names
        tp_names = tp_mesh.mesh_dim_names
        if dp_names is None or tp_names is None or any(n is None for n in names):
            raise ValueError(
                f"{where}: {fqn!r} is a DTensor on mesh {tp_mesh}; composing FSDP with it needs "
                f"named meshes (the fully_shard mesh has names {dp_names}, the parameter's {tp_names})"
            )
        if set(dp_names) & set(tp_names):
            raise ValueError(
                f"{where}: {fqn!r}: the fully_shard mesh {dp_names} and the parameter's mesh "
                f"{tp_names} share an axis name; expected distinct axes of one mesh"
            )
        for mesh in list(_live_meshes.values()):
            have = mesh.mesh_dim_names
            if have is None or not set(names) <= set(have) or mesh.get_coordinate() is None:
                continue
            if mesh[dp_names] == info.mesh and mesh[tp_names] == tp_mesh:
                return mesh[names]
        raise ValueError(
            f"{where}: {fqn!r} lives on mesh {tp_names} and FSDP's mesh is {dp_names}; expected "
            f"both to be slices of one DeviceMesh with axes {names} (e.g. mesh['dp'] and mesh['tp'])"
        )

    return find


def _replaced_by_fully_shard(p: torch.Tensor) -> str | None:
    """Where fully_shard replaced ``p`` by a sharded parameter, or None."""
    entry = _replaced_params.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]
