"""``fully_shard``: torch's FSDP2 API over hp DTensors.

``fully_shard`` checks its arguments (:mod:`._arguments`), wraps each managed parameter
in an :class:`~hyper_parallel.dtensor.fsdp._param_group.FSDPParam`, and hands the group
to an :class:`~hyper_parallel.dtensor.fsdp._state.FSDPState`, whose hooks drive it; the
module's class becomes ``FSDP<Original>`` (:class:`FSDPModule`), as torch's.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Literal, cast, overload

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.fsdp._api import MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.dtensor.fsdp._arguments import (
    ShardPlacementFn,
    _check_reshard_after_forward,
    _device_of,
    _fqn,
    _joint_finder,
    _managed_params,
    _mesh_info,
    _mesh_or_default,
    _replaced_by_fully_shard,
    _replaced_params,
    _shard_dim,
)
from hyper_parallel.dtensor.fsdp._param_group import (
    FSDPParam,
    FSDPParamGroup,
    spmd_layout,
)
from hyper_parallel.dtensor.fsdp._state import FSDPState, _roots, _state_of
from hyper_parallel.dtensor.placement_types import Placement

__all__ = [
    "FSDPModule",
    "HSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]

_optimizer_hook_installed = False


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
