"""``fully_shard``: torch's FSDP2 API over hp DTensors.

The state of one ``fully_shard`` call (:class:`FSDPState`) owns one
:class:`~hyper_parallel.dtensor.fsdp._param_group.FSDPParamGroup` and the hooks that
drive it, as torch's ``FSDPState`` does:

- forward pre-hook: all-gather the group (and the modules set to forward-prefetch);
- forward post-hook: reshard if ``reshard_after_forward``, cast outputs, and hook the
  outputs so that their first gradient re-all-gathers a resharded group (pre-backward);
- a post-accumulate-grad hook on each unsharded parameter: when the group's last
  gradient is there, one reduce-scatter writes the sharded gradients;
- the root's callback at the end of backward (``queue_callback``) reduces the groups
  whose parameters did not all get a gradient and resets the iteration.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast, overload

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, _entered, _live_meshes, init_device_mesh
from hyper_parallel.dtensor.fsdp._api import MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.dtensor.fsdp._param_group import (
    FSDPParam,
    FSDPParamGroup,
    MeshInfo,
    Slot,
    spmd_layout,
)
from hyper_parallel.dtensor.placement_types import Placement, Shard

__all__ = [
    "FSDPModule",
    "HSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]

# Parameters fully_shard replaced (by id, with a weak reference to tell a reused id): an
# optimizer still holding one was built too early.
_replaced_params: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
_default_mesh: DeviceMesh | None = None
_optimizer_hook_installed = False


class FSDPState:
    """The hooks and flags of one ``fully_shard`` call over ``modules``."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup,
        mp: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        auto_reshard: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.forward_prefetch: list[FSDPModule] = []
        self.backward_prefetch: list[FSDPModule] = []
        self.is_last_backward = True
        self._forwarded: set[int] = set()
        self._callback_queued = False
        self._all_states: list[FSDPState] = []  # the root's: every state under it

    # -- lazy init -------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        # The first state to run forward is the root: the states under it are not.
        self.is_root = True
        states: list[FSDPState] = []
        for module in self.modules:
            for sub in module.modules():
                state = _state_of(sub)
                if state is not None and state not in states:
                    states.append(state)
        for state in states:
            if state is not self:
                state.is_root = False
        if self.auto_reshard:
            self.reshard_after_forward = False
        self._all_states = states

    # -- forward -----------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._lazy_init()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        self.group.unshard()
        for other in self.forward_prefetch:
            other._get_fsdp_state().group.unshard()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        # fully_shard([a, b]): the group reshards once the last of its modules ran forward
        self._forwarded.add(id(module))
        if len(self._forwarded) >= len(self.modules):
            self._forwarded.clear()
            if self.reshard_after_forward:
                self.group.reshard()
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        if self.mp.output_dtype is not None:
            output = _cast_floats(output, self.mp.output_dtype)
        return output

    # -- backward ----------------------------------------------------------------------
    def _pre_backward(self, _: torch.Tensor) -> None:
        root = self._root()
        if root is not None and not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._post_backward_final)
        if self.group.in_backward:
            return
        self.group.in_backward = True
        self.group.unshard()
        for other in self.backward_prefetch:
            other._get_fsdp_state().group.unshard()

    def _root(self) -> FSDPState | None:
        if self.is_root:
            return self
        for state in _all_root_states():
            if self in state._all_states:
                return state
        return None

    def _post_backward_final(self) -> None:
        self._callback_queued = False
        for state in reversed(self._all_states):
            group = state.group
            if group.in_backward or group.is_unsharded:
                group.post_backward()
                if group.reshard_after_backward:
                    group.reshard()
            group.reset_backward()


_roots: weakref.WeakSet[Any] = weakref.WeakSet()


def _all_root_states() -> list[FSDPState]:
    return [m._get_fsdp_state() for m in _roots]


def _state_of(module: nn.Module) -> FSDPState | None:
    state = getattr(module, "_hp_fsdp_state", None)
    return state if isinstance(state, FSDPState) else None


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast_one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast_one, tree)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns; ``wait()`` ends the unshard.

    hp's collectives complete when they return, so ``wait()`` has nothing left to wait for.

    Example::

        handle = model.unshard(async_op=True)
        handle.wait()
    """

    def wait(self) -> None:
        """Wait for the all-gather (already complete)."""


class FSDPModule:
    """The class ``fully_shard`` mixes into a module (``FSDP<Original>``), as torch's.

    Example::

        fully_shard(model)
        isinstance(model, FSDPModule)   # True
        model.set_requires_gradient_sync(False)
    """

    _hp_fsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Indexing a container of FSDP modules builds the original class, as in torch.
        orig_cls: Any = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        return self._hp_fsdp_state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (one all-gather; not recursive).

        Example::

            model.layers[1].unshard()
        """
        self._hp_fsdp_state.group.unshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive).

        Example::

            model.reshard()
        """
        self._hp_fsdp_state.group.reshard()

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        modules = cast(nn.Module, self).modules() if recurse else [cast(nn.Module, self)]
        states: list[FSDPState] = []
        for module in modules:
            state = _state_of(module)
            if state is not None and state not in states:
                states.append(state)
        return states

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients; ``False`` accumulates them unreduced.

        Example::

            model.set_requires_gradient_sync(False)   # micro-batches without communication
        """
        for state in self._fsdp_states(recurse):
            state.group.reduce_grads = requires_gradient_sync
            state.group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces over the replicate axis after reduce-scattering.

        Example::

            model.set_requires_all_reduce(False)
        """
        for state in self._fsdp_states(recurse):
            state.group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at runtime (a bool, as torch's).

        Example::

            model.set_reshard_after_forward(True)
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward: expected a bool, found "
                f"{type(reshard_after_forward).__name__}"
            )
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            state.auto_reshard = False

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward frees the unsharded parameters after reducing their gradients.

        Example::

            model.set_reshard_after_backward(False)
        """
        for state in self._fsdp_states(recurse):
            state.group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (kept for torch's API).

        Example::

            model.set_is_last_backward(False)
        """
        self._hp_fsdp_state.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Modules to all-gather in this module's pre-forward.

        Example::

            model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
        """
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")
        self._hp_fsdp_state.forward_prefetch = list(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Modules to all-gather in this module's pre-backward.

        Example::

            model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
        """
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")
        self._hp_fsdp_state.backward_prefetch = list(modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size.

        Example::

            model.set_gradient_divide_factor(1.0)   # sum the gradients
        """
        for state in self._fsdp_states(True):
            state.group.divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with "sum" collectives only (hp always does: the division is a local op).

        Example::

            model.set_force_sum_reduction_for_comms(True)
        """
        for state in self._fsdp_states(True):
            state.group.force_sum_reduction = enable

    def set_reduce_op_type(self, reduce_op_type: Literal["avg", "sum"]) -> None:
        """Upstream's name: ``"avg"`` averages gradients (the default), ``"sum"`` sums them.

        Example::

            model.set_reduce_op_type("sum")
        """
        if reduce_op_type not in ("avg", "sum"):
            raise ValueError(
                f"set_reduce_op_type: expected 'avg' or 'sum', found {reduce_op_type!r}"
            )
        for state in self._fsdp_states(True):
            state.group.divide_factor = None if reduce_op_type == "avg" else 1.0

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # to_empty / to(...) rebuild the sharded parameters, possibly as new objects and
        # possibly without calling the nested modules' _apply: reshard the whole subtree
        # first, and afterwards take every group's sharded parameters from the modules.
        states = self._fsdp_states(True)
        for state in states:
            state.group.reshard()
        result = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        for state in states:
            state.group.refresh_sharded()
        return result


HSDPModule = FSDPModule
"""Upstream hyper-parallel's name for an HSDP module: the same class."""


def _check_fsdp_modules(modules: Iterable[Any], where: str) -> None:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"{where}: expected FSDP modules (fully_shard applied), found {bad}")


def _fsdp_class(cls: type[nn.Module]) -> type:
    cached = _fsdp_classes.get(cls)
    if cached is None:
        cached = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _fsdp_classes[cls] = cached
    return cached


_fsdp_classes: dict[type, type] = {}


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.method_name`` (a no-op off FSDP), as torch's.

    Example::

        register_fsdp_forward_method(model, "generate")
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}")
    orig = getattr(module, method_name)
    state = module._get_fsdp_state()

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(cast(nn.Module, module), args, kwargs)
        return state.post_forward(cast(nn.Module, module), orig(*args, **kwargs))

    setattr(module, method_name, wrapped)


# -- fully_shard --------------------------------------------------------------------------


ShardPlacementFn = Callable[[nn.Parameter], Shard | None]


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    device: torch.device | str | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: ShardPlacementFn | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    device: torch.device | str | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen, as torch)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    device: torch.device | str | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh``'s data-parallel ranks, as torch's ``fully_shard``.

    A 1-D ``mesh`` shards each parameter as ``(Shard(0),)``; a 2-D mesh is HSDP:
    ``(Replicate(), Shard(0))`` (replicate over dim 0, shard over dim 1). A parameter
    that is already a DTensor of a 1-D TP mesh becomes one DTensor on the joint mesh
    of ``mesh`` and that TP mesh (both slices of one named ``DeviceMesh``): a Rowwise
    weight is ``(Shard(0), Shard(1))`` on ``(dp, tp)``; where FSDP and TP shard the
    same dim (a Colwise weight), it is torch's ``(_StridedShard(0, sf=tp), Shard(0))``
    on ``(dp, tp)``: rank ``(i, j)`` holds FSDP's ``i``-th chunk of the ``j``-th TP shard
    (at uneven sizes that placement cannot describe, ``(Shard(0), Shard(0))`` on
    ``(tp, dp)``, the same shards stated in nesting order).

    ``reshard_after_forward``: ``None`` reshards non-root modules after forward and
    keeps the root unsharded; ``True``/``False`` as given; an int must divide the
    shard size (``1`` is ``False``, the shard size is ``True``). ``device`` is
    upstream's argument: when given it must be the mesh's device type. ``module`` is
    returned, its class swapped to ``FSDP<Class>``.

    Example::

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(x).sum(); loss.backward()      # grads are (Shard(0),) DTensors
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    where = f"fully_shard({', '.join(type(m).__name__ for m in modules)})"
    if not modules:
        raise ValueError(f"{where}: expected a module or a non-empty list of modules, found []")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where}: expected nn.Module(s), found {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"{where}: fully_shard was already applied to this {type(m).__name__}; "
                "apply it once per module"
            )
    if mesh is None:
        mesh = _mesh_or_default(device)
    info = _mesh_info(mesh, where)
    dev = _device_of(mesh, device, where)
    raf = _check_reshard_after_forward(reshard_after_forward, info, where)
    ignored = set(ignored_params or ())
    slots_by_param = _managed_params(modules, ignored, where)
    layouts: dict[nn.Parameter, tuple[int, tuple[DeviceMesh, tuple[Placement, ...]]]] = {}
    for param, slots in slots_by_param.items():
        fqn = _fqn(modules, slots[0])
        dim = _shard_dim(param, shard_placement_fn, info, fqn, where)
        layouts[param] = (
            dim,
            spmd_layout(param, info, dim, _joint_finder(info, param, where, fqn)),
        )
    # validated: from here on the modules change
    params: list[FSDPParam] = []
    for param, slots in slots_by_param.items():
        dim, spmd = layouts[param]
        fsdp_param = FSDPParam(
            param, slots, info, dim, dev, spmd, mp_policy, offload_policy, _fqn(modules, slots[0])
        )
        fsdp_param.register(fsdp_param.sharded_param)
        _replaced_params[id(param)] = (weakref.ref(param), f"{fsdp_param.fqn!r} of {where}")
        params.append(fsdp_param)
    for m in modules:  # buffers follow the parameters to the device, as torch
        for name, buf in list(m._buffers.items()):
            if buf is not None and buf.device.type != "meta" and buf.device != dev:
                m._buffers[name] = buf.to(dev)
    group = FSDPParamGroup(params, info, mp_policy, dev)
    state = FSDPState(modules, group, mp_policy, raf, reshard_after_forward is None)
    for m in modules:
        m._hp_fsdp_state = state  # type: ignore[assignment]
        m.__class__ = _fsdp_class(type(m))
        m.register_forward_pre_hook(_pre_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_hook, prepend=False)
        m.register_state_dict_pre_hook(_reshard_hook)  # type: ignore[no-untyped-call]
        m._register_load_state_dict_pre_hook(_reshard_hook, with_module=True)  # type: ignore[no-untyped-call]
        _roots.add(m)
    _install_optimizer_check()
    if isinstance(module, list):
        return [cast(FSDPModule, m) for m in modules]
    return cast(FSDPModule, module)


def _own_state(module: nn.Module) -> FSDPState:
    state = _state_of(module)
    assert state is not None
    return state


def _pre_hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    return _own_state(module).pre_forward(module, args, kwargs)


def _post_hook(module: nn.Module, args: Any, output: Any) -> Any:
    return _own_state(module).post_forward(module, output)


def _reshard_hook(module: nn.Module, *args: Any) -> None:
    # state_dict() and load_state_dict() see the sharded DTensors, as torch's
    _own_state(module).group.reshard()


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


def _install_optimizer_check() -> None:
    global _optimizer_hook_installed
    if _optimizer_hook_installed:
        return
    _optimizer_hook_installed = True

    checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()

    def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # once per optimizer and parameter count (add_param_group re-checks), not every step
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if checked.get(optimizer) == count:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                assert isinstance(p, torch.Tensor)
                if _replaced_by_fully_shard(p) is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__}.step: it holds a parameter of shape "
                        f"{tuple(p.shape)} that fully_shard replaced by a sharded DTensor; build "
                        "the optimizer after fully_shard, from model.parameters()"
                    )
        checked[optimizer] = count

    register_optimizer_step_pre_hook(check)
