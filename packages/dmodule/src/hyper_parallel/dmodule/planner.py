"""Plan a model's parallelization against a mesh: each state's layout, each forward's boundaries, every problem at once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hyper_parallel.dmodule._forward import (
    ForwardPlan,
    OutputLayout,
    forward_signature,
    resolve_output_layout,
)
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.sharding import ShardingConfig, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement, axis_name
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Shard,
    normalize_placements,
)

__all__ = [
    "ModulePlan",
    "ShardingError",
    "StatePlan",
    "check_sharding",
    "declaration_problems",
    "plan_parallelize",
    "validate_sharding",
]


class ShardingError(ValueError):
    """A model's sharding declarations do not fit a mesh; ``problems`` lists each one.

    Example::

        >>> str(ShardingError("Linear", ["Linear.weight: bad"]))
        'Linear.parallelize: 1 sharding problem(s):\\n  Linear.weight: bad'
    """

    def __init__(self, owner: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            f"{owner}.parallelize: {len(problems)} sharding problem(s):\n  " + "\n  ".join(problems)
        )


@runtime_checkable
class _ShardableModule(Protocol):
    """What validation reads of a :class:`~hyper_parallel.dmodule.Module` (``module.py``
    imports this file, so it is matched by these members rather than imported)."""

    @property
    def sharding_config(self) -> ShardingConfig | None: ...

    @property
    def is_parallelized(self) -> bool: ...


def _is_dmodule(module: torch.nn.Module) -> bool:
    return isinstance(module, _ShardableModule)


@dataclass
class StatePlan:
    """One parameter or buffer to lay out: where it lives and its resolved placements."""

    owner: torch.nn.Module
    name: str
    tensor: torch.Tensor
    placements: list[Placement]
    is_parameter: bool
    mesh: DeviceMesh


@dataclass
class ModulePlan:
    """What ``parallelize`` does to one :class:`Module` of the tree."""

    path: str
    module: torch.nn.Module
    states: list[StatePlan] = field(default_factory=list)
    forward: ForwardPlan | None = None


def validate_sharding(model: torch.nn.Module, mesh: DeviceMesh | ParallelDims) -> list[str]:
    """Every problem of ``model``'s sharding declarations against ``mesh`` (empty: it fits).

    Example::

        >>> validate_sharding(model, mesh)  # doctest: +SKIP
        ["Linear.weight: sharding_config names mesh axis 'tpp'; mesh axes are ('dp', 'tp')"]
    """
    return plan_parallelize(model, mesh)[1]


def check_sharding(model: torch.nn.Module, mesh: DeviceMesh | ParallelDims) -> None:
    """Raise :class:`ShardingError` listing every problem of ``model`` against ``mesh``.

    Example::

        >>> check_sharding(model, mesh)  # doctest: +SKIP
    """
    problems = validate_sharding(model, mesh)
    if problems:
        raise ShardingError(type(model).__name__, problems)


def plan_parallelize(
    model: torch.nn.Module, mesh: DeviceMesh | ParallelDims
) -> tuple[list[ModulePlan], list[str]]:
    """Resolve every :class:`Module`'s sharding in ``model`` against ``mesh``; no mutation.

    With a :class:`ParallelDims`, each state and each forward lives on the view that holds
    the axes its layout names (the expert view for ``ep``/``efsdp``/``etp``, else the dense
    one; see :meth:`ParallelDims.view_for`); its meshes must have been built.
    Returns the plans (pre-order) and the problems found; the plans are only
    meaningful when there are no problems.

    Example::

        >>> plans, problems = plan_parallelize(model, mesh)  # doctest: +SKIP
    """
    if isinstance(mesh, ParallelDims):
        planner = _Planner(mesh.world_mesh, (), dims=mesh)
    elif not isinstance(mesh, DeviceMesh):
        return [], [
            f"parallelize: expected a DeviceMesh or a ParallelDims, found {type(mesh).__name__}"
        ]
    else:
        names = mesh.mesh_dim_names
        if not names:
            return [], [
                f"parallelize: the mesh {mesh} has no mesh_dim_names; sharding_config names "
                "mesh axes, so create it with init_device_mesh(..., mesh_dim_names=(...))"
            ]
        planner = _Planner(mesh, tuple(names))
    plans: list[ModulePlan] = []
    local_map_roots: list[str] = []
    for path, sub in model.named_modules(remove_duplicate=True):
        if not _is_dmodule(sub):
            continue
        label = _label(sub, path)
        if sub.is_parallelized:
            planner.problems.append(
                f"{label}: already parallelized; Module.parallelize() may be called at most "
                "once per module"
            )
            continue
        plan = ModulePlan(path, sub)
        plans.append(plan)
        sc = sub.sharding_config
        if sc is None:
            continue
        if not isinstance(sc, ShardingConfig):
            planner.problems.append(
                f"{label}: expected a ShardingConfig, found {type(sc).__name__}"
            )
            continue
        inside = [root for root in local_map_roots if _is_within(path, root)]
        if inside and _has_io_shardings(sc) and sc.local_map is None:
            # a local_map block inside one is an inner region (plain tensors both sides)
            planner.problems.append(
                f"{label}: declares input/output shardings but runs inside the local_map "
                f"block {inside[-1]!r}, whose forward sees local tensors only"
            )
        planner.plan_states(plan, sc)
        check = getattr(sub, "layout_problems", None)
        if callable(check) and plan.states:
            found = check({state.name: (state.mesh, state.placements) for state in plan.states})
            planner.problems.extend(f"{label}: {problem}" for problem in found)
        plan.forward = planner.plan_forward(sub, path, sc)
        if sc.local_map is not None and sc.local_map.state_grad_placements:
            planner.problems.extend(_state_grad_problems(label, sc, planner))
        if sc.local_map is not None:
            planner.problems.extend(_undeclared_state_grads(label, sub, sc))
        if sc.local_map is not None:
            local_map_roots.append(path)
    return plans, planner.problems


def declaration_problems(module: torch.nn.Module, sc: ShardingConfig) -> list[str]:
    """What is wrong with ``sc`` as ``module``'s own layout, whatever the mesh (empty: nothing).

    The checks that need no mesh, as :func:`plan_parallelize` makes them: each
    ``state_shardings`` path names a parameter or buffer of ``module``, and each
    ``in_src_shardings``/``in_dst_shardings`` key an argument its ``forward`` takes. Axis
    names and shard dims are checked against the mesh, by ``parallelize``.

    Example::

        >>> from hyper_parallel.dmodule import ShardingConfig
        >>> declaration_problems(torch.nn.Linear(2, 2), ShardingConfig(state_shardings={"w": {}}))
        ["Linear.w: sharding_config names a state that does not exist: no parameter or buffer 'w'; it has ['weight', 'bias']"]
    """
    label = _label(module, "")
    problems: list[str] = []
    for state_path in sc.state_shardings:
        found = _find_state(module, state_path)
        if isinstance(found, str):
            where = _where(module, "", state_path)
            problems.append(f"{where}: sharding_config names a state that does not exist: {found}")
    _, named, var_kw = forward_signature(type(module))
    for kind, spec in (
        ("in_src_shardings", sc.in_src_shardings),
        ("in_dst_shardings", sc.in_dst_shardings),
    ):
        for arg in spec or {}:
            if arg not in named and not var_kw:
                problems.append(_unknown_argument(label, kind, arg, module, named))
    return problems


def _unknown_argument(
    label: str, kind: str, arg: str, module: torch.nn.Module, named: frozenset[str]
) -> str:
    return (
        f"{label}: {kind} names argument {arg!r}, which {type(module).__name__}.forward does "
        f"not take; its arguments are {sorted(named)}"
    )


def _label(module: torch.nn.Module, path: str) -> str:
    name = type(module).__name__
    return f"{name} at {path!r}" if path else name


def _where(module: torch.nn.Module, path: str, item: str) -> str:
    name = f"{type(module).__name__}.{item}"
    return f"{name} (at {path!r})" if path else name


def _is_within(path: str, root: str) -> bool:
    return path != root and (root == "" or path.startswith(root + "."))


def _linear_input_features(module: torch.nn.Module, positional: tuple[str, ...]) -> dict[str, int]:
    """``{first input: in_features}`` of a linear (``nn.Linear`` or anything with ``in_features``)."""
    features = getattr(module, "in_features", None)
    if not positional or isinstance(features, bool) or not isinstance(features, int):
        return {}
    return {positional[0]: features}


def _has_io_shardings(sc: ShardingConfig) -> bool:
    return any(
        x is not None
        for x in (
            sc.in_src_shardings,
            sc.in_dst_shardings,
            sc.out_src_shardings,
            sc.out_dst_shardings,
        )
    )


def _find_state(module: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str, bool] | str:
    """``(owner, name, is_parameter)`` of a dotted state path, or why it is not one."""
    *parents, leaf = path.split(".")
    owner = module
    for i, part in enumerate(parents):
        child = owner._modules.get(part)
        if child is None:
            return f"{'.'.join(parents[: i + 1])!r} is not a submodule"
        owner = child
    if leaf in owner._parameters:
        return owner, leaf, True
    if leaf in owner._buffers:
        return owner, leaf, False
    known = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return f"no parameter or buffer {path!r}; it has {known}"


def _normalized(
    placements: list[Placement] | tuple[Placement, ...], ndim: int, where: str
) -> tuple[Placement, ...]:
    return normalize_placements(tuple(placements), len(placements), ndim, where=where)


def _grad_placements_by_name(
    spec: object,
    label: str,
    module: torch.nn.Module,
    positional: tuple[str, ...],
    problems: list[str],
) -> Mapping[str, NamedPlacement] | None:
    """``local_map.in_grad_placements`` by argument name (upstream's tuple is positional)."""
    if not isinstance(spec, tuple):
        return spec if isinstance(spec, Mapping) else None
    if spec and len(spec) != len(positional):  # () is the default: nothing declared
        problems.append(
            f"{label}: local_map.in_grad_placements has {len(spec)} entries, but "
            f"{type(module).__name__}.forward takes {len(positional)} positional inputs "
            f"{list(positional)}; give one entry per input, in order (None where there is "
            "nothing to declare)"
        )
        return None
    return {name: entry for name, entry in zip(positional, spec, strict=False) if entry is not None}


@dataclass
class _Planner:
    """Resolves each module's sharding against one mesh, collecting every problem found.

    ``claimed`` remembers which module first laid out a tensor, so a state shared by two
    modules gets one layout (or a problem naming both).
    """

    mesh: DeviceMesh
    axes: tuple[str, ...]
    dims: ParallelDims | None = None
    problems: list[str] = field(default_factory=list)
    claimed: dict[int, tuple[str, list[Placement]]] = field(default_factory=dict)

    def _view(self, named_axes: list[object], where: str) -> tuple[DeviceMesh, tuple[str, ...]]:
        """The mesh (and its axes) a layout naming ``named_axes`` lives on."""
        if self.dims is None:
            return self.mesh, self.axes
        names = [axis_name(a) for a in named_axes if isinstance(a, str)]
        try:
            view = self.dims.view_for(names)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return view, tuple(view.mesh_dim_names or ())

    def _resolve(
        self, named: NamedPlacement, where: str, mesh: DeviceMesh | None = None
    ) -> list[Placement] | None:
        """``named`` as one placement per axis of ``mesh`` (default: its own view's)."""
        try:
            if mesh is None:
                mesh, axes = self._view(list(named) if isinstance(named, Mapping) else [], where)
            else:
                axes = tuple(mesh.mesh_dim_names or ())
            return resolve_placements(named, axes, where=where)
        except (TypeError, ValueError) as error:
            self.problems.append(str(error))
            return None

    def plan_states(self, plan: ModulePlan, sc: ShardingConfig) -> None:
        """Append to ``plan.states`` the layout of each state ``sc`` names."""
        module, path = plan.module, plan.path
        if not isinstance(sc.state_shardings, Mapping):
            self.problems.append(
                f"{_label(module, path)}: state_shardings must map state paths to placements, "
                f"found {sc.state_shardings!r}"
            )
            return
        for state_path, named in sc.state_shardings.items():
            where = _where(module, path, state_path)
            found = _find_state(module, state_path)
            if isinstance(found, str):
                self.problems.append(
                    f"{where}: sharding_config names a state that does not exist: {found}"
                )
                continue
            owner, name, is_parameter = found
            tensor = (owner._parameters if is_parameter else owner._buffers)[name]
            if tensor is None:
                self.problems.append(f"{where}: the state is None; only tensors can be sharded")
                continue
            try:
                mesh, axes = self._view(list(named) if isinstance(named, Mapping) else [], where)
            except ValueError as error:
                self.problems.append(str(error))
                continue
            placements = self._resolve(named, where, mesh)
            if placements is None:
                continue
            bad = False
            for axis, p in zip(axes, placements, strict=True):
                if isinstance(p, Partial):
                    self.problems.append(
                        f"{where}: mesh axis {axis!r}: states are laid out with Shard(dim) or "
                        f"Replicate(), found {p!r}"
                    )
                    bad = True
                elif isinstance(p, Shard) and not -tensor.ndim <= p.dim < tensor.ndim:
                    self.problems.append(
                        f"{where}: mesh axis {axis!r}: Shard(dim={p.dim}) is out of range for a "
                        f"tensor of shape {tuple(tensor.shape)} ({tensor.ndim} dims)"
                    )
                    bad = True
            if bad:
                continue
            wanted = _normalized(placements, tensor.ndim, where)
            if isinstance(tensor, DTensor):
                if (
                    tensor.device_mesh != mesh
                    or _normalized(tensor.placements, tensor.ndim, where) != wanted
                ):
                    self.problems.append(
                        f"{where}: already a DTensor on {tensor.device_mesh} with placements "
                        f"{tensor.placements}, but sharding_config expects {list(wanted)} on {mesh}"
                    )
                continue
            previous = self.claimed.get(id(tensor))
            if previous is not None:
                if _normalized(previous[1], tensor.ndim, where) != wanted:
                    self.problems.append(
                        f"{where}: the same tensor is also {previous[0]} with placements "
                        f"{previous[1]}; a shared state has one layout, found {placements}"
                    )
                continue
            self.claimed[id(tensor)] = (where, placements)
            plan.states.append(StatePlan(owner, name, tensor, placements, is_parameter, mesh))

    def plan_forward(
        self, module: torch.nn.Module, path: str, sc: ShardingConfig
    ) -> ForwardPlan | None:
        """The resolved input/output layouts of ``module``'s forward (None: it declares none)."""
        if not _has_io_shardings(sc) and sc.local_map is None:
            return None
        label = _label(module, path)
        try:
            mesh, axes = self._view(_boundary_axes(sc), label)
        except ValueError as error:
            self.problems.append(str(error))
            return None
        positional, named, var_kw = forward_signature(type(module))
        resolved: dict[str, dict[str, tuple[Placement, ...]]] = {}
        grad_spec = (
            _grad_placements_by_name(
                sc.local_map.in_grad_placements, label, module, positional, self.problems
            )
            if sc.local_map is not None
            else None
        )
        for kind, spec in (
            ("in_src_shardings", sc.in_src_shardings),
            ("in_dst_shardings", sc.in_dst_shardings),
            ("local_map.in_grad_placements", grad_spec),
        ):
            resolved[kind] = {}
            if spec is None:
                continue
            if not isinstance(spec, Mapping):
                self.problems.append(
                    f"{label}: {kind} must map forward argument names to placements, found {spec!r}"
                )
                continue
            for arg, item in spec.items():
                where = f"{_where(module, path, arg)} ({kind})"
                if arg not in named and not var_kw:
                    self.problems.append(_unknown_argument(label, kind, arg, module, named))
                    continue
                placements = self._resolve(item, where, mesh)
                if placements is not None:
                    resolved[kind][arg] = tuple(placements)
        outputs: dict[str, OutputLayout | None] = {}
        for kind, out_spec in (
            ("out_src_shardings", sc.out_src_shardings),
            ("out_dst_shardings", sc.out_dst_shardings),
        ):
            outputs[kind] = None
            if out_spec is None:
                continue
            try:
                outputs[kind] = resolve_output_layout(out_spec, axes, where=f"{label} ({kind})")
            except (TypeError, ValueError) as error:
                self.problems.append(str(error))
        return ForwardPlan(
            owner=label,
            mesh=mesh,
            positional_names=positional,
            in_src=resolved["in_src_shardings"],
            in_dst=resolved["in_dst_shardings"],
            out_src=outputs["out_src_shardings"],
            out_dst=outputs["out_dst_shardings"],
            local_map=sc.local_map is not None,
            in_grad=resolved["local_map.in_grad_placements"],
            compile=sc.local_map is not None and sc.local_map.compile,
            in_features=_linear_input_features(module, positional),
        )


def _state_grad_problems(label: str, sc: ShardingConfig, planner: _Planner) -> list[str]:
    """``local_map.state_grad_placements`` names declared states, with valid placements.

    The placements are resolved on the mesh the state lives on (under a ``ParallelDims``,
    the view its ``state_shardings`` names), as the states' node resolves them.
    """
    assert sc.local_map is not None
    problems = []
    for name, named in sc.local_map.state_grad_placements.items():
        where = f"{label}: local_map.state_grad_placements[{name!r}]"
        if name not in sc.state_shardings:
            problems.append(
                f"{where}: not a state of state_shardings; its states are "
                f"{sorted(sc.state_shardings)}"
            )
            continue
        layout = sc.state_shardings[name]
        try:
            _, axes = planner._view(list(layout) if isinstance(layout, Mapping) else [], where)
            resolve_placements(named, axes, where=where)
        except (TypeError, ValueError) as error:
            problems.append(str(error))
    return problems


def _undeclared_state_grads(label: str, module: torch.nn.Module, sc: ShardingConfig) -> list[str]:
    """A ``local_map`` block's trainable parameter replicated over an axis its input is sharded on.

    Its local gradient is then either a partial sum over this rank's shard (a norm weight
    under sequence parallelism: ``Partial``) or already whole (``Replicate``, when the
    block gathers before using it); only the block knows, so it must say which in
    ``local_map.state_grad_placements``; taking it as replicated by default gave a wrong
    gradient without a word.
    """
    assert sc.local_map is not None
    sharded: dict[str, str] = {}  # axis -> the input sharded over it
    dst = sc.in_dst_shardings
    layouts = dst.items() if isinstance(dst, Mapping) else enumerate(dst or ())
    for where, layout in layouts:
        if isinstance(layout, Mapping):
            for axis, placement in layout.items():
                if isinstance(placement, Shard):
                    sharded.setdefault(axis_name(axis), str(where))
    if not sharded:
        return []
    declared = sc.local_map.state_grad_placements or {}
    problems = []
    for name, param in module.named_parameters(recurse=False):
        if not param.requires_grad or name in declared:
            continue
        own = {axis_name(a): p for a, p in (sc.state_shardings.get(name) or {}).items()}
        for axis, arg in sharded.items():
            if not isinstance(own.get(axis), Shard):
                problems.append(
                    f"{label}: parameter {name!r} is replicated over {axis!r} while input "
                    f"{arg!r} is sharded over it, so its local gradient may sum this rank's "
                    f"shard only; declare local_map.state_grad_placements={{{name!r}: "
                    f"{{{axis!r}: Partial()}}}} (a per-token weight such as a norm's), or "
                    f"Replicate() if the block gathers the input before using it"
                )
                break
    return problems


def _named_axes(spec: object) -> list[object]:
    """Every mesh axis a boundary layout names (placements by axis, nested in outputs)."""
    if isinstance(spec, Mapping):
        if any(isinstance(v, Placement) for v in spec.values()):
            return list(spec)
        return [axis for value in spec.values() for axis in _named_axes(value)]
    if isinstance(spec, (list, tuple)):
        return [axis for item in spec for axis in _named_axes(item)]
    return []


def _boundary_axes(sc: ShardingConfig) -> list[object]:
    """The axes a module's forward boundaries name: one view holds all of them."""
    specs: list[object] = [
        sc.in_src_shardings,
        sc.in_dst_shardings,
        sc.out_src_shardings,
        sc.out_dst_shardings,
    ]
    if sc.local_map is not None:
        specs.append(sc.local_map.in_grad_placements)
    return [axis for spec in specs for axis in _named_axes(spec)]
