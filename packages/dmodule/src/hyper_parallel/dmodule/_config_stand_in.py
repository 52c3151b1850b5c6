"""The stand-in ``Config`` of a Module subclass that declares none: its ``build()`` says so."""

from __future__ import annotations

from dataclasses import dataclass


def _inherited_config(cls: type) -> type:
    """A stand-in ``cls.Config`` for a Module subclass that declares none: its build() raises."""
    parent: type = cls.Config  # type: ignore[attr-defined]  # the inherited one
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": f"{cls.__qualname__}.Config",
        "__doc__": f"Stand-in: {cls.__name__} declares no Config of its own.",
        "_hp_inherited_by": cls,
    }
    stand_in = type("Config", (parent,), namespace)
    return dataclass(kw_only=True, slots=True)(stand_in)


def _no_own_config_message(cls: type, config_cls: type) -> str:
    parent = config_cls.__mro__[1]
    parent_owner = getattr(parent, "_hp_owner", None)
    built = parent_owner.__name__ if isinstance(parent_owner, type) else "nothing"
    if cls.__dict__.get("_hp_wrapped_nn") is not None:
        nn_cls = cls.__dict__["_hp_wrapped_nn"]
        return (
            f"Module.from_nn_module({nn_cls.__module__}.{nn_cls.__qualname__}) has no Config to "
            f"build from: construct it with its own arguments ({cls.__name__}(...)), and declare "
            f"its sharding in its parent's ShardingConfig with dotted state paths (e.g. "
            f"state_shardings={{'proj.weight': {{'tp': Shard(0)}}}})"
        )
    return (
        f"{cls.__qualname__} declares no Config of its own, so {cls.__name__}.Config().build() "
        f"would build {built}, not {cls.__name__}; declare "
        f"`@dataclass(kw_only=True, slots=True) class Config({parent.__qualname__})` inside "
        f"{cls.__name__}"
    )
