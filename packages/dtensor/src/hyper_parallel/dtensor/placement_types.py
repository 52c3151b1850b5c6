"""Placements: how one mesh axis lays a tensor out (Shard, Replicate, Partial)."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["Partial", "Placement", "ReduceOp", "Replicate", "Shard"]

ReduceOp = Literal["sum", "avg", "product", "max", "min"]
_REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "product", "max", "min")


# Every placement value's one object, per class (see Placement).
_instances_of: dict[type, dict[Any, Any]] = {}


class Placement:
    """Base class of the placements of a tensor along one mesh axis.

    Placements are immutable values: equal by value, hashable, and printed as the
    expression that made them. There is one object per value (``Shard(0) is Shard(0)``),
    so equality and hashing are identity's: the dispatcher compares and hashes
    placements in every cache key, and identity costs no Python call there.

    Example::

        >>> Shard(0) == Shard(0), Replicate() == Replicate()
        (True, True)
    """

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _instances_of[cls] = {}

    def is_shard(self, dim: int | None = None) -> bool:
        """True for ``Shard`` (of ``dim``, when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for ``Replicate``."""
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """True for ``Partial`` (of ``reduce_op``, when given), as torch's ``Placement.is_partial``."""
        return False

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot delete {name!r}")


class Shard(Placement):
    """The tensor is split along tensor dimension ``dim`` across the mesh axis.

    Chunks follow ``torch.chunk``: the first chunks hold ``ceil(size / n)``
    elements, later ones may be smaller or empty.

    Example::

        >>> Shard(1)
        Shard(dim=1)
    """

    __slots__ = ("dim",)
    dim: int

    def __new__(cls, dim: int) -> Shard:
        interned = _instances_of[cls]
        key = (type(dim), dim)  # the type too: True == 1, and Shard(True) must still raise
        if key in interned:  # subscripts, not dict.get: no Python call on the common path
            return interned[key]  # type: ignore[no-any-return]
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard(dim): expected an int tensor dimension, found {dim!r}")
        found = interned[key] = object.__new__(cls)
        object.__setattr__(found, "dim", int(dim))
        return found  # type: ignore[no-any-return]

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __reduce__(self) -> tuple[type[Shard], tuple[int]]:
        return (Shard, (self.dim,))


class Replicate(Placement):
    """Every rank along the mesh axis holds the whole tensor.

    Example::

        >>> Replicate()
        Replicate()
    """

    __slots__ = ()

    def __new__(cls) -> Replicate:
        interned = _instances_of[cls]
        if () in interned:
            return interned[()]  # type: ignore[no-any-return]
        found = interned[()] = object.__new__(cls)
        return found  # type: ignore[no-any-return]

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __reduce__(self) -> tuple[type[Replicate], tuple[()]]:
        return (Replicate, ())


class Partial(Placement):
    """Every rank holds a partial value; the tensor is their reduction by ``reduce_op``.

    ``reduce_op`` is one of ``"sum"``, ``"avg"``, ``"product"``, ``"max"``, ``"min"``
    (torch's names; ``"product"`` is what ``prod`` over a sharded dim gives). torch's
    other spelling ``"prod"`` is accepted and means ``"product"``.

    Example::

        >>> Partial(), Partial("max")
        (Partial(reduce_op='sum'), Partial(reduce_op='max'))
    """

    __slots__ = ("reduce_op",)
    reduce_op: ReduceOp

    def __new__(cls, reduce_op: ReduceOp | Literal["prod"] = "sum") -> Partial:
        interned = _instances_of[cls]
        key = (type(reduce_op), reduce_op)
        if key in interned:
            return interned[key]  # type: ignore[no-any-return]
        name = "product" if reduce_op == "prod" else reduce_op
        if name not in _REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op): expected one of {_REDUCE_OPS} (or 'prod'), found "
                f"{reduce_op!r}"
            )
        found = interned.get((str, name))
        if found is None:
            found = interned[(str, name)] = object.__new__(cls)
            object.__setattr__(found, "reduce_op", str(name))
        interned[key] = found
        return found  # type: ignore[no-any-return]

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or self.reduce_op == reduce_op

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"

    def __reduce__(self) -> tuple[type[Partial], tuple[str]]:
        return (Partial, (self.reduce_op,))
