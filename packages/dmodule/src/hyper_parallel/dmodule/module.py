"""Module: a configurable layer with declarative initialisation and tensor parallelism."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch

from hyper_parallel.config import ConfigError, Configurable, enforce_module_config_slots
from hyper_parallel.dmodule._config_stand_in import _inherited_config, _no_own_config_message
from hyper_parallel.dmodule._forward import ForwardPlan
from hyper_parallel.dmodule._parallel_forward import _parallel_class
from hyper_parallel.dmodule._state_checks import (
    arm_state_check,
    mark_replaced,
    snapshot_states,
    watch_fresh_states,
)
from hyper_parallel.dmodule._state_tree import (
    apply_tree,
    as_parameter,
    device_type_of,
    same_tensor,
    states_on_meta,
    tied_slots,
)
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.planner import ShardingError, declaration_problems, plan_parallelize
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dtensor import DeviceMesh, DTensor, Placement, distribute_tensor
from hyper_parallel.platform import get_platform

__all__ = ["Module", "ModuleDict", "ModuleList", "ParamInit", "Sequential", "distribute_state"]

# At import on purpose: Module's base class is the platform's Module, needed to define it.
platform = get_platform()

if TYPE_CHECKING:
    _PlatformModule = torch.nn.Module
else:
    _PlatformModule = platform.Module

ParamInit = Callable[[torch.Tensor], object]
"""An initializer: called with the parameter (a DTensor once parallelized), fills it in place."""

_M = TypeVar("_M", bound="Module")

# Per platform class, its Module wrapper (see Module.from_nn_module).
_wrapped_classes: dict[type, type] = {}


# Positional parameter names of each class's forward (the signature is read once per class).
def distribute_state(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: list[Placement]
) -> DTensor:
    """Lay a full state tensor out over ``mesh`` (meta tensors give meta shards, no comm).

    Real tensors are taken from the mesh's first rank (group rank 0 on every axis, as
    torch's ``src_data_rank`` means), so every rank ends up with slices of the same
    values even if their copies differed.

    Example::

        w = distribute_state(torch.randn(8, 4), mesh, [Shard(0)])
    """
    src: int | None = None if tensor.is_meta else 0
    return distribute_tensor(tensor.detach(), mesh, placements, src_data_rank=src)


class Module(_PlatformModule, Configurable):
    """A layer built from its ``Config``, initialised by ``init_states``, sharded by ``parallelize``.

    Subclasses declare a ``Config`` (hyperparameters, ``param_init``, ``sharding_config``)
    and ``__init__(self, config)``; build with ``Config(...).build()``.

    Example::

        >>> from dataclasses import dataclass
        >>> from hyper_parallel.dtensor import Shard
        >>> from hyper_parallel.dmodule import MeshAxisName, ShardingConfig
        >>> class Linear(Module):
        ...     @dataclass(kw_only=True, slots=True)
        ...     class Config(Module.Config):
        ...         in_features: int = 8
        ...         out_features: int = 4
        ...         param_init = {"weight": torch.nn.init.kaiming_uniform_}
        ...         sharding_config = ShardingConfig(
        ...             state_shardings={"weight": {MeshAxisName.TP: Shard(0)}})
        ...     def __init__(self, config: Config) -> None:
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(
        ...             torch.empty(config.out_features, config.in_features))
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return torch.nn.functional.linear(x, self.weight)
        >>> layer = Linear.Config().build()
        >>> layer.init_states()
        >>> layer(torch.ones(2, 8)).shape   # then layer.parallelize(tp_mesh)
        torch.Size([2, 4])
    """

    _param_init: dict[str, ParamInit] | None = None
    _sharding_config: ShardingConfig | None = None
    # Set by set_sharding_config only (None included: no layout of its own); absent otherwise.
    _hp_replaced_sharding: ShardingConfig | None
    _parallelized: bool = False
    _hp_forward_plan: ForwardPlan | None = None
    # Set by parallelize and _apply: some own state is a meta tensor (no memory yet).
    _hp_states_on_meta: bool = False
    # The class a parallel subclass was made from (set on those subclasses only).
    _hp_parallel_base: ClassVar[type | None] = None

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """Per-layer config: initializers and the sharding spec.

        ``param_init`` maps each of the layer's own parameter names to an initializer
        applied by :meth:`Module.init_states`; ``sharding_config`` is consumed by
        :meth:`Module.parallelize`.

        Example::

            >>> from hyper_parallel.dmodule import ShardingConfig
            >>> Module.Config(param_init={"weight": torch.nn.init.ones_}).sharding_config is None
            True
        """

        param_init: dict[str, ParamInit] | None = None
        sharding_config: ShardingConfig | None = None

        def build(self, **kwargs: Any) -> Any:
            """Build the layer and attach ``param_init`` and ``sharding_config`` to it.

            Example::

                >>> Linear.Config(in_features=16).build()  # doctest: +SKIP
            """
            inherited_by = type(self).__dict__.get("_hp_inherited_by")
            if inherited_by is not None:
                raise ConfigError(_no_own_config_message(inherited_by, type(self)))
            instance = Configurable.Config.build(self, **kwargs)
            if isinstance(instance, Module):
                # The layer's own copy when it keeps one, else a fresh copy: never the template's.
                kept = instance.__dict__.get("config")
                config = kept if isinstance(kept, Module.Config) else self.replace()
                instance._param_init = config.param_init
                instance._sharding_config = config.sharding_config
                unknown = instance._unknown_initializers()
                if unknown:
                    raise ConfigError(unknown[0][1], path=f"param_init.{unknown[0][0]}")
                if states_on_meta(instance):
                    # built on meta: a forward on real inputs is refused until to_empty()
                    arm_state_check(instance)
            return instance

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is not None:
            enforce_module_config_slots(config_cls, cls.__name__)
        elif "_hp_parallel_base" not in cls.__dict__:
            # Without a Config of its own, cls.Config would be the parent's and build the
            # parent: a stand-in that says so on build() instead.
            type.__setattr__(cls, "Config", _inherited_config(cls))

    # -- declared specs ----------------------------------------------------------------
    @property
    def param_init(self) -> dict[str, ParamInit] | None:
        """Initializers by parameter name (from the Config this module was built from)."""
        if self._param_init is not None:
            return self._param_init
        config = self.__dict__.get("config")
        return config.param_init if isinstance(config, Module.Config) else None

    @property
    def sharding_config(self) -> ShardingConfig | None:
        """Sharding spec used by :meth:`parallelize` (from the Config this module was built from,
        or the one :meth:`set_sharding_config` put in its place)."""
        if "_hp_replaced_sharding" in self.__dict__:
            return self._hp_replaced_sharding
        if self._sharding_config is not None:
            return self._sharding_config
        config = self.__dict__.get("config")
        return config.sharding_config if isinstance(config, Module.Config) else None

    def set_sharding_config(self, config: ShardingConfig | None) -> ShardingConfig | None:
        """Replace the layout :meth:`parallelize` gives this module; return the one it had.

        For a plan that chooses among layouts after the model is built (qwen3's plan gives
        each MoE its expert-tensor-parallel layout this way). ``None``: no layout of its
        own. ``config`` is checked as the declared one is, before anything changes: a
        :class:`ShardingConfig` whose state paths name this module's parameters or buffers
        and whose input shardings name arguments of its ``forward`` (axis names and shard
        dims are checked against the mesh by ``parallelize``). Refused once the module is
        parallelized: its states are laid out already. Passing the returned layout back
        undoes the change.

        Example::

            >>> from hyper_parallel.dmodule import MeshAxisName, ShardingConfig
            >>> from hyper_parallel.dmodule.layers import Linear
            >>> from hyper_parallel.dtensor import Shard
            >>> layer = Linear.Config(in_features=8, out_features=4).build()
            >>> rowwise = ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(1)}})
            >>> declared = layer.set_sharding_config(rowwise)
            >>> layer.sharding_config.state_shardings
            {'weight': {MeshAxisName.TP: Shard(dim=1)}}
            >>> layer.set_sharding_config(declared) is rowwise
            True
        """
        owner = type(self)._hp_parallel_base or type(self)
        where = f"{owner.__name__}.set_sharding_config"
        if config is not None and not isinstance(config, ShardingConfig):
            raise TypeError(f"{where}: expected a ShardingConfig or None, found {config!r}")
        if self._parallelized:
            raise ValueError(
                f"{where}: the module is parallelized already, its states laid out by the "
                "layout it had; replace a layout before parallelize()"
            )
        problems = [] if config is None else declaration_problems(self, config)
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        previous = self.sharding_config
        self._hp_replaced_sharding = config
        return previous

    @property
    def is_parallelized(self) -> bool:
        """True once :meth:`parallelize` has run on this module (or an ancestor)."""
        return self._parallelized

    # -- initialisation ----------------------------------------------------------------
    def init_states(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Initialise this subtree: children first, then own parameters, then own buffers.

        Parameters are filled by ``param_init`` (plain ``nn`` children by their
        ``reset_parameters``), in module order, on the parameters as they are -- DTensors
        after :meth:`parallelize`, so each rank fills only its shard with the slice of
        the values a single-device build would get after the same ``torch.manual_seed``.
        Buffers come from :meth:`_init_self_buffers`; a buffer that was a DTensor is laid
        out the same way again. Every missing initializer is reported before anything
        is touched.

        Example::

            >>> layer = Linear.Config().build()  # doctest: +SKIP
            >>> layer.init_states()               # doctest: +SKIP
        """
        problems = _missing_initializers(self, "")
        if problems:
            raise ValueError(
                f"{type(self).__name__}.init_states: missing initializers:\n  "
                + "\n  ".join(problems)
            )
        on_meta = states_on_meta(self)
        if on_meta:
            shown = ", ".join(repr(n) for n in on_meta[:3]) + (", ..." if len(on_meta) > 3 else "")
            raise ValueError(
                f"{type(self).__name__}.init_states: {len(on_meta)} parameter(s)/buffer(s) are "
                f"on the meta device ({shown}), so there is no memory to initialise; call "
                f"model.to_empty(device=...) first (after parallelize, before init_states)"
            )
        self._init_subtree(buffer_device)

    def _init_subtree(self, buffer_device: torch.device | str | None) -> None:
        for child in self.children():
            _init_module(child, buffer_device)
        self._init_self_parameters()
        layouts = {
            name: (buf.device_mesh, list(buf.placements))
            for name, buf in self._buffers.items()
            if isinstance(buf, DTensor)
        }
        self._init_self_buffers(buffer_device=buffer_device)
        for name, (mesh, placements) in layouts.items():
            buf = self._buffers.get(name)
            if buf is not None and not isinstance(buf, DTensor):
                self._buffers[name] = distribute_state(buf, mesh, placements)

    def _init_self_parameters(self) -> None:
        """Apply ``param_init`` to each own parameter, in registration order."""
        inits = self.param_init or {}
        with torch.no_grad():
            for name, param in self._parameters.items():
                if param is not None:
                    result = inits[name](param)
                    if isinstance(result, torch.Tensor) and not same_tensor(result, param):
                        raise ValueError(
                            f"{type(self).__name__}.{name}: param_init[{name!r}] "
                            f"({_describe_init(inits[name])}) returned a new tensor instead of "
                            "filling the parameter in place; expected an initializer like "
                            "torch.nn.init.normal_ that writes into its argument (and returns "
                            "it or None)"
                        )

    def _unknown_initializers(self) -> list[tuple[str, str]]:
        """``(name, why)`` for each ``param_init`` entry that names no own parameter or is not callable."""
        if type(self)._init_self_parameters is not Module._init_self_parameters:
            return []
        cls = getattr(type(self), "_hp_parallel_base", None) or type(self)
        owner = cls.__name__
        own = sorted(self._parameters)
        found: list[tuple[str, str]] = []
        for name, init in (self.param_init or {}).items():
            if name not in self._parameters:
                close = difflib.get_close_matches(name, own, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                found.append(
                    (
                        name,
                        f"{owner}.Config.param_init names {name!r}, which is not a parameter of "
                        f"{owner}; its parameters are {own}{hint}",
                    )
                )
            elif not callable(init):
                found.append(
                    (
                        name,
                        f"{owner}.{name}: param_init[{name!r}] is {type(init).__name__} "
                        f"{init!r}; expected a callable that fills the tensor in place",
                    )
                )
        return found

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Hook: (re)create this module's own buffers, e.g. on ``buffer_device``."""

    def _missing_initializer(self, name: str) -> str | None:
        """Why own parameter ``name`` has no initializer, or None when it has one."""
        if type(self)._init_self_parameters is not Module._init_self_parameters:
            return None  # a subclass initialising its own way answers for its parameters
        inits = self.param_init
        if inits is not None and name in inits:
            return None
        cls = type(self).__name__
        if inits is None:
            return f"{cls}.{name}: no initializer; {cls}.Config.param_init is not set"
        return f"{cls}.{name}: no initializer in {cls}.Config.param_init; it has {sorted(inits)}"

    # -- parallelism -------------------------------------------------------------------
    def parallelize(self: _M, mesh: DeviceMesh | ParallelDims) -> _M:
        """Shard this subtree's states and wrap forwards per each module's ``sharding_config``.

        Every sharding of the subtree is checked first (mesh axes, state paths, shard
        dims, forward argument names); on any problem it raises listing all of them and
        changes nothing. Otherwise states become DTensors (attributes of the
        parameters kept) and a module with input/output shardings runs
        ``redistribute inputs -> forward -> redistribute outputs``. Callable once.

        With a :class:`ParallelDims` (its meshes are built here if they were not), each
        state and each forward lives on the view holding the axes its layout names:
        expert weights naming ``ep`` on the expert view, dense ones on the dense view.

        Example::

            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            model = Linear.Config().build().parallelize(mesh)
            model = Qwen3.Config().build().parallelize(ParallelDims(tp=2, ep=2))
        """
        if isinstance(mesh, ParallelDims):
            mesh.build_mesh(None if mesh.is_built else device_type_of(self))
        plans, problems = plan_parallelize(self, mesh)
        if problems:
            raise ShardingError(type(self).__name__, problems)
        # Build every new state first (collectives happen here), then commit by assignment.
        replaced: dict[int, torch.Tensor] = {}
        for plan in plans:
            for state in plan.states:
                if id(state.tensor) in replaced or isinstance(state.tensor, DTensor):
                    continue
                new: torch.Tensor = distribute_state(state.tensor, state.mesh, state.placements)
                if state.is_parameter:
                    new = as_parameter(new, state.tensor)
                replaced[id(state.tensor)] = new
        root = type(self).__name__
        for prefix, sub in self.named_modules():
            state_dicts: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
            for states in state_dicts:
                for name, value in states.items():
                    if value is not None and id(value) in replaced:
                        states[name] = replaced[id(value)]
                        if states is sub._parameters:
                            # an optimizer built before parallelize holds the old object:
                            # its step() is refused instead of silently changing nothing
                            fqn = f"{prefix}.{name}" if prefix else name
                            mark_replaced(value, f"{root}.{fqn} (replaced by parallelize())")
        for plan in plans:
            module = cast("Module", plan.module)
            if plan.forward is not None:
                module._hp_forward_plan = plan.forward
                module.__class__ = _parallel_class(type(module))
            module._parallelized = True
            module._hp_states_on_meta = bool(states_on_meta(module, recurse=False))
        return self

    def layout_problems(self, layouts: dict[str, tuple[DeviceMesh, list[Placement]]]) -> list[str]:
        """Hook: what is wrong with the layouts ``parallelize`` resolved for own states (by name).

        Called during planning, on every rank, before anything changes; each problem is
        reported like a sharding problem. A layer whose math needs more than a valid
        layout (e.g. whole experts per rank) says so here.

        Example::

            >>> Module().layout_problems({})
            []
        """
        return []

    def _apply(self: _M, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _M:
        # torch's _apply swaps a converted wrapper-subclass parameter into the old object
        # (torch.utils.swap_tensors), which drops the Parameter's Python attributes and fails
        # outright on a tensor that has a weak reference; DTensor states are re-registered,
        # once per tensor object so that tied parameters stay tied.
        before = snapshot_states(self, recurse=recurse)
        tied = tied_slots(self) if recurse else []
        apply_tree(self, fn, {}, recurse=recurse)
        for first, *others in tied:  # torch's _apply makes one new Parameter per slot: re-tie
            for module, name in others:
                module._parameters[name] = first[0]._parameters[first[1]]
        for sub in self.modules() if recurse else (self,):
            if isinstance(sub, Module) and sub._parallelized:
                sub._hp_states_on_meta = bool(states_on_meta(sub, recurse=False))
        watch_fresh_states(self, before, everything=self._hp_emptying)
        return self

    _hp_emptying: bool = False

    def to_empty(self: _M, *, device: torch.device | str | int | None, recurse: bool = True) -> _M:
        """torch's ``to_empty``; a forward before the states are filled is then refused.

        The states get memory without values. Until :meth:`init_states` (or a load, or
        any in-place write) fills a state, a forward raises naming it -- one check at the
        first forward, none after.

        Example::

            >>> with torch.device("meta"):
            ...     layer = Linear.Config().build()  # doctest: +SKIP
            >>> layer.to_empty(device="cpu").init_states()  # doctest: +SKIP
        """
        self._hp_emptying = True
        try:
            torch.nn.Module.to_empty(self, device=device, recurse=recurse)
        finally:
            del self._hp_emptying
        return self

    @classmethod
    def from_nn_module(cls, nn_module_cls: type[torch.nn.Module]) -> type[Module]:
        """A :class:`Module` subclass of a platform ``nn`` class, initialised by ``reset_parameters``.

        Cached per class, so ``from_nn_module(nn.Linear) is from_nn_module(nn.Linear)``.

        Example::

            >>> Conv2d = Module.from_nn_module(torch.nn.Conv2d)
            >>> layer = Conv2d(3, 16, kernel_size=3)
            >>> layer.init_states()
        """
        cached = _wrapped_classes.get(nn_module_cls)
        if cached is not None:
            return cached
        if not (isinstance(nn_module_cls, type) and issubclass(nn_module_cls, torch.nn.Module)):
            raise TypeError(
                f"Module.from_nn_module: expected a {platform.Module.__name__} subclass, "
                f"found {nn_module_cls!r}"
            )
        attrs: dict[str, Any] = {
            "__module__": __name__,
            "__qualname__": nn_module_cls.__name__,
            "__doc__": nn_module_cls.__doc__,
            "_hp_wrapped_nn": nn_module_cls,
        }
        if hasattr(nn_module_cls, "reset_parameters"):
            attrs["_init_self_parameters"] = _reset_own_parameters
        new_cls = type(nn_module_cls.__name__, (nn_module_cls, Module), attrs)
        _wrapped_classes[nn_module_cls] = new_cls
        return new_cls


def _reset_own_parameters(self: Any) -> None:
    self.reset_parameters()


def _init_module(module: torch.nn.Module, buffer_device: torch.device | str | None) -> None:
    """Initialise a child: a Module by its own rules, a plain one by ``reset_parameters``."""
    if isinstance(module, Module):
        module._init_subtree(buffer_device)
        return
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    for child in module.children():
        _init_module(child, buffer_device)


def _missing_initializers(module: torch.nn.Module, path: str) -> list[str]:
    """Every own parameter of the subtree that ``init_states`` could not initialise."""
    problems: list[str] = []
    where = f" (at {path!r})" if path else ""
    own = [name for name, p in module._parameters.items() if p is not None]
    if isinstance(module, Module):
        problems += [f"{why}{where}" for n in own if (why := module._missing_initializer(n))]
        problems += [f"{why}{where}" for _, why in module._unknown_initializers()]
    elif own and not callable(getattr(module, "reset_parameters", None)):
        cls = type(module).__name__
        problems += [
            f"{cls}.{name}{where}: no initializer; a plain {cls} needs reset_parameters() "
            f"(or wrap it with Module.from_nn_module)"
            for name in own
        ]
    for name, child in module.named_children():
        problems += _missing_initializers(child, f"{path}.{name}" if path else name)
    return problems


def _describe_init(init: object) -> str:
    name = getattr(init, "__qualname__", None) or getattr(init, "__name__", None)
    return str(name) if name else repr(init)


# The platform's containers as Modules. They are written out as classes, not made by
# from_nn_module, so that type checkers see each as both its nn container and a Module;
# the class attributes below are the ones from_nn_module would set, and the registration
# after them makes from_nn_module(nn.ModuleList) return these very classes.
class ModuleList(torch.nn.ModuleList, Module):
    """``torch.nn.ModuleList`` that is a :class:`Module`: ``init_states`` reaches its members.

    Example::

        >>> layers = ModuleList([Module.from_nn_module(torch.nn.Linear)(4, 4) for _ in range(2)])
        >>> layers.init_states()
        >>> len(layers)
        2
    """

    _hp_wrapped_nn = torch.nn.ModuleList


class ModuleDict(torch.nn.ModuleDict, Module):
    """``torch.nn.ModuleDict`` that is a :class:`Module`: ``init_states`` reaches its members.

    Example::

        >>> heads = ModuleDict({"a": Module.from_nn_module(torch.nn.Linear)(4, 2)})
        >>> heads.init_states()
        >>> list(heads)
        ['a']
    """

    _hp_wrapped_nn = torch.nn.ModuleDict


class Sequential(torch.nn.Sequential, Module):
    """``torch.nn.Sequential`` that is a :class:`Module`: ``init_states`` reaches its members.

    Example::

        >>> net = Sequential(Module.from_nn_module(torch.nn.Linear)(4, 2), torch.nn.ReLU())
        >>> net.init_states()
        >>> net(torch.ones(1, 4)).shape
        torch.Size([1, 2])
    """

    _hp_wrapped_nn = torch.nn.Sequential


_wrapped_classes.update(
    {
        torch.nn.ModuleList: ModuleList,
        torch.nn.ModuleDict: ModuleDict,
        torch.nn.Sequential: Sequential,
    }
)
