"""Placements: how one mesh axis lays a tensor out (Shard, _StridedShard, Replicate, Partial)."""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "Partial",
    "Placement",
    "ReduceOp",
    "Replicate",
    "Shard",
    "_StridedShard",
    "is_shard_like",
]

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


class _StridedShard(Placement):
    """A shard of a shard: tensor dim ``dim`` split across the mesh axis as if later axes split it first.

    torch's ``_StridedShard`` (same name, ``repr``, ``str`` and semantics): the dim, as
    this mesh axis sees it, is cut into ``split_factor`` pieces (``torch.chunk``), each
    piece is cut into one chunk per rank of the axis, and a rank holds its chunk of every
    piece, in order. It is what FSDP writes on the data-parallel axis of a parameter that
    tensor parallelism already shards on the same dim (``split_factor`` = the TP degree):
    ``(_StridedShard(0, sf=2), Shard(0))`` on ``(dp, tp)`` holds on rank ``(i, j)`` the
    ``i``-th FSDP chunk of the ``j``-th TP shard. Views that merge a sharded dim into a
    leading one (``flatten`` of ``Shard(2)``) keep their shards this way too. Like torch's,
    it is not a ``Shard``: ``is_shard()`` is ``False`` and ``_StridedShard(0, sf=1) !=
    Shard(0)``.

    Example::

        >>> _StridedShard(0, split_factor=2)
        _StridedShard(dim=0, sf=2)
    """

    __slots__ = ("dim", "split_factor")
    dim: int
    split_factor: int

    def __new__(cls, dim: int, *, split_factor: int = 1, sf: int | None = None) -> _StridedShard:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard: pass split_factor or sf, not both")
            split_factor = sf
        interned = _instances_of[cls]
        key = (type(dim), dim, type(split_factor), split_factor)
        if key in interned:
            return interned[key]  # type: ignore[no-any-return]
        for name, value in (("dim", dim), ("split_factor", split_factor)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"_StridedShard({name}): expected an int, found {value!r}")
        if split_factor < 1:
            raise ValueError(f"_StridedShard(split_factor): expected >= 1, found {split_factor}")
        found = interned[key] = object.__new__(cls)
        object.__setattr__(found, "dim", int(dim))
        object.__setattr__(found, "split_factor", int(split_factor))
        return found  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def __reduce__(self) -> tuple[object, tuple[int, int]]:
        return (_strided_shard, (self.dim, self.split_factor))


def _strided_shard(dim: int, split_factor: int) -> _StridedShard:
    """Unpickle a ``_StridedShard`` (its ``split_factor`` is keyword-only)."""
    return _StridedShard(dim, split_factor=split_factor)


def is_shard_like(p: Placement) -> bool:
    """True for ``Shard`` and ``_StridedShard`` (a placement that splits a tensor dim).

    Example::

        >>> is_shard_like(_StridedShard(0, sf=2)), is_shard_like(Replicate())
        (True, False)
    """
    return isinstance(p, (Shard, _StridedShard))


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
