"""``DeviceMesh``: an n-d grid of ranks with named axes and one process group per axis slice.

A mesh pickles as its value (device type, ranks, axis names); unpickled in a process
that holds a mesh of the same value it reattaches to that mesh's process groups, as
torch's mesh resolves its groups by name. Elsewhere it comes back *detached*: its
shape, names and coordinate are there, its groups are not, and a collective on it
raises naming the mesh to build first.

Meshes of equal value share their process groups: a mesh axis's slice over given ranks
(with a given axis name and device type) has one process group per process group world,
whichever mesh asks first creates it. Equal meshes compare equal (as torch's do), so
anything that finds, caches or groups meshes by value (dispatch caches, unpickling,
``fully_shard``'s joint-mesh search, ``clip_grad_norm_``'s grouping) may hand one job a
mesh object another job built; with one group per value that is harmless. With a group
per mesh object it hung: which of two equal meshes a lookup found depended on garbage
collection, which differs between ranks, so two ranks ran one all-reduce on two
different groups.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DeviceMesh", "current_mesh", "init_device_mesh"]

Axis = int | str

MeshKey = tuple[str, tuple[int, ...], tuple[int, ...], "tuple[str, ...] | None"]


class _LiveMeshes:
    """Every mesh alive in this process, by value: what an unpickled mesh reattaches to.

    Weak, so a mesh nobody holds is not kept alive (nor its groups) by having been built.
    All the meshes of one value are kept, not only the first: two jobs in one process
    build equal meshes, and the older one, garbage in a reference cycle, may be collected
    while the newer one lives on; remembering one per value would then forget the live one.
    """

    def __init__(self) -> None:
        self._by_value: dict[MeshKey, list[weakref.ref[DeviceMesh]]] = {}

    def add(self, mesh: DeviceMesh) -> None:
        """Remember ``mesh`` (which holds its process groups) until it is collected."""
        key = mesh._value_key
        self._by_value.setdefault(key, []).append(weakref.ref(mesh, self._forgetter(key)))

    def _forgetter(self, key: MeshKey) -> Callable[[weakref.ref[DeviceMesh]], None]:
        def forget(dead: weakref.ref[DeviceMesh]) -> None:
            refs = self._by_value.get(key)
            if refs is None:
                return
            refs[:] = [ref for ref in refs if ref is not dead]
            if not refs:
                del self._by_value[key]

        return forget

    def get(self, key: MeshKey) -> DeviceMesh | None:
        """The newest live mesh of value ``key``, or None."""
        for ref in reversed(self._by_value.get(key, ())):
            mesh = ref()
            if mesh is not None:
                return mesh
        return None

    def values(self) -> list[DeviceMesh]:
        """Every live mesh, the newest of each value first."""
        found = []
        for refs in list(self._by_value.values()):
            found += [mesh for ref in reversed(list(refs)) if (mesh := ref()) is not None]
        return found


_live_meshes = _LiveMeshes()

#: (device type, axis name or index, slice ranks) -> its process group
GroupKey = tuple[str, "str | int", tuple[int, ...]]


class _SliceGroups:
    """The process group of every mesh-axis slice built so far, by value (see the module
    docstring): a second mesh of an equal value reuses the first one's groups.

    Held as long as the default process group lives (keyed weakly by it): torch keeps every
    group alive until ``destroy_process_group`` anyway, and releasing them with it (not at
    interpreter exit, after torch's teardown) lets gloo join its threads in order. Never
    garbage dependent while the world lives: every rank creates every slice's group
    (``new_group`` is collective), so the lookups hit and miss alike on every rank.
    """

    def __init__(self) -> None:
        self._by_world: weakref.WeakKeyDictionary[object, dict[GroupKey, ProcessGroup]] = (
            weakref.WeakKeyDictionary()
        )

    def get_or_create(self, key: GroupKey, description: str) -> ProcessGroup:
        """The group of slice ``key`` (collective on the first call for it, as ``new_group``)."""
        world = torch.distributed.group.WORLD
        if world is None:  # no process group: new_group says so
            return get_platform().new_group(list(key[2]), description=description)
        groups = self._by_world.setdefault(world, {})
        group = groups.get(key)
        if group is None:
            group = get_platform().new_group(list(key[2]), description=description)
            groups[key] = group
        return group


_slice_groups = _SliceGroups()


def _remember_mesh(mesh: DeviceMesh) -> None:
    """Record ``mesh``, which holds its process groups, as a live mesh of its value."""
    _live_meshes.add(mesh)


def _axis_of_group(group: ProcessGroup) -> str | int | None:
    """The mesh axis (its name, or index on a mesh without names) whose group on this rank
    is ``group``, in any live mesh; None when no live mesh holds it."""
    for mesh in _live_meshes.values():
        for index, held in mesh._groups.items():
            if held is group:
                return mesh.mesh_dim_names[index] if mesh.mesh_dim_names else index
    return None


# The meshes entered with ``with mesh:``, innermost last (torch's mesh stack).
_entered: ContextVar[tuple[DeviceMesh, ...]] = ContextVar("hp_entered_meshes", default=())


def current_mesh(where: str) -> DeviceMesh:
    """The innermost mesh entered with ``with mesh:``; raises when none is.

    Example::

        with mesh:
            assert current_mesh("example") is mesh
    """
    stack = _entered.get()
    if not stack:
        raise RuntimeError(
            f"{where}: no device_mesh given and no mesh is active; pass device_mesh= or run "
            "inside `with mesh:`"
        )
    return stack[-1]


class DeviceMesh:
    """An n-dimensional grid of global ranks; each axis is a family of process groups.

    ``mesh[i, j]`` is the global rank at coordinate ``(i, j)``. Along each axis,
    the ranks that differ only in that axis's coordinate form one process group;
    all of them are created at construction (every rank creates every group of
    every axis, in the same order) and cached, and this rank keeps the ones it
    belongs to. Collective: every rank of the world constructs the same meshes in
    the same order. The default process group is initialised if needed.

    The mesh may cover a subset of the world; on ranks outside it the
    rank-dependent methods raise and ``get_coordinate()`` returns ``None``.

    Example::

        >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        >>> mesh.shape, mesh.size("tp"), mesh["tp"].mesh.tolist()  # on rank 2
        ((2, 2), 2, [2, 3])
    """

    device_type: str
    mesh: torch.Tensor
    mesh_dim_names: tuple[str, ...] | None
    #: Number of mesh axes (an attribute, not a property: the dispatcher reads it per op).
    ndim: int
    _groups: dict[int, ProcessGroup]
    _coordinate: list[int] | None

    def __init__(
        self,
        device_type: str,
        mesh: Sequence[object] | torch.Tensor,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
    ) -> None:
        platform = get_platform()
        platform.ensure_device_type(device_type)
        ranks = _as_rank_tensor(mesh)
        names = _check_names(mesh_dim_names, ranks.dim())
        if not platform.is_initialized():
            platform.init_process_group(device_type)
        world_size = platform.get_world_size()
        flat = ranks.flatten().tolist()
        if len(flat) > world_size:
            raise ValueError(
                f"DeviceMesh: mesh of shape {tuple(ranks.shape)} holds {len(flat)} ranks but the "
                f"world size is {world_size}; expected at most {world_size} ranks"
            )
        bad = [rank for rank in flat if not 0 <= rank < world_size]
        if bad:
            raise ValueError(
                f"DeviceMesh: ranks must be in [0, {world_size}) (the world size), got {bad}"
            )
        duplicates = sorted({rank for rank in flat if flat.count(rank) > 1})
        if duplicates:
            raise ValueError(f"DeviceMesh: each rank may appear once; repeated ranks {duplicates}")
        self._setup(device_type, ranks, names, platform.get_rank(), groups=None)
        _remember_mesh(self)

    def _setup(
        self,
        device_type: str,
        ranks: torch.Tensor,
        names: tuple[str, ...] | None,
        rank: int,
        groups: Mapping[int, ProcessGroup] | None,
    ) -> None:
        self.device_type = device_type
        self.mesh = ranks
        self.mesh_dim_names = names
        self._rank = rank
        where = (ranks == rank).nonzero()
        self._coordinate = where[0].tolist() if len(where) else None
        # value identity, computed once: specs hash and compare meshes on every op dispatch
        self._shape = tuple(int(s) for s in ranks.shape)
        self.ndim = len(self._shape)
        self._groups = dict(groups) if groups is not None else self._create_groups()
        self._sub_meshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._axis_groups: dict[tuple[Axis, type], tuple[int, ProcessGroup]] = {}
        self._value_key: MeshKey = (
            device_type,
            self._shape,
            tuple(ranks.flatten().tolist()),
            names,
        )
        self._value_hash = hash(self._value_key)

    def _create_groups(self) -> dict[int, ProcessGroup]:
        """Every slice group of every axis, in the same order on all ranks: an equal slice's
        group where one was built before (:class:`_SliceGroups`), else a new one."""
        groups: dict[int, ProcessGroup] = {}
        for axis in range(self.ndim):
            slices = self.mesh.movedim(axis, -1).reshape(-1, self.mesh.shape[axis])
            label: str | int = self.mesh_dim_names[axis] if self.mesh_dim_names else axis
            name = repr(label) if self.mesh_dim_names else str(axis)
            for slice_ranks in slices.tolist():
                # named in errors, e.g. a lost peer's: "mesh axis 'dp' of DeviceMesh(...)"
                key: GroupKey = (self.device_type, label, tuple(slice_ranks))
                group = _slice_groups.get_or_create(key, f"mesh axis {name} of {self}")
                if self._rank in slice_ranks:
                    groups[axis] = group
        return groups

    # -- shape -------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """Number of ranks along each axis."""
        return self._shape

    def axis_index(self, axis: Axis) -> int:
        """Index of ``axis`` given by name or (possibly negative) index.

        Example::

            >>> mesh.axis_index("tp"), mesh.axis_index(-1)  # mesh axes ("dp", "tp")
            (1, 1)
        """
        if type(axis) is int and 0 <= axis < self.ndim:
            return axis  # the common case (every collective asks), checked without a call
        if isinstance(axis, str):
            if self.mesh_dim_names is None:
                raise ValueError(
                    f"DeviceMesh: axis {axis!r} given by name but this mesh has no axis names "
                    f"(mesh_dim_names=None); use an index in [0, {self.ndim})"
                )
            if axis not in self.mesh_dim_names:
                raise ValueError(
                    f"DeviceMesh: no axis named {axis!r}; mesh axes are {self.mesh_dim_names}"
                )
            return self.mesh_dim_names.index(axis)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"DeviceMesh: axis must be an int or a str, got {axis!r}")
        if not -self.ndim <= axis < self.ndim:
            raise ValueError(
                f"DeviceMesh: axis {axis} is out of range for a {self.ndim}-d mesh "
                f"(valid: {-self.ndim}..{self.ndim - 1}{self._names_hint()})"
            )
        return axis % self.ndim

    def size(self, axis: Axis | None = None, *, dim: Axis | None = None) -> int:
        """Ranks along ``axis`` (name or index), or in the whole mesh when None.

        ``dim`` is an alias of ``axis`` for torch.distributed compatibility.

        Example::

            >>> mesh.size(), mesh.size("tp")  # a (2, 2) mesh
            (4, 2)
        """
        axis = _alias(axis, dim)
        if axis is None:
            return self.mesh.numel()
        return int(self.mesh.shape[self.axis_index(axis)])

    # -- this rank -----------------------------------------------------------------
    def get_rank(self) -> int:
        """This process's global rank.

        Example::

            >>> mesh.get_rank()  # doctest: +SKIP
            3
        """
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the mesh, or None when it is not in the mesh.

        Example::

            >>> mesh.get_coordinate()  # rank 3 of a (2, 2) mesh
            [1, 1]
        """
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, axis: Axis | None = None, *, dim: Axis | None = None) -> int:
        """This rank's coordinate along ``axis`` (its rank in that axis's group).

        ``axis`` may be omitted only on a 1-d mesh; ``dim`` is an alias of ``axis``.

        Example::

            >>> mesh.get_local_rank("dp"), mesh.get_local_rank("tp")  # rank 1 of (2, 2)
            (0, 1)
        """
        index = self._axis_or_only(_alias(axis, dim), "get_local_rank")
        return self._require_coordinate("get_local_rank")[index]

    def get_group(self, axis: Axis | None = None) -> ProcessGroup:
        """The process group of this rank's slice along ``axis`` (None only on a 1-d mesh).

        Example::

            >>> group = mesh.get_group("tp")  # doctest: +SKIP
        """
        index = self._axis_or_only(axis, "get_group")
        self._require_coordinate("get_group")
        group = self._groups.get(index)
        if group is None:
            raise RuntimeError(
                f"DeviceMesh.get_group: {self} was unpickled in a process holding no mesh of "
                "that value, so it has no process groups; build the mesh (init_device_mesh / "
                "DeviceMesh with the same ranks and names) before loading"
            )
        return group

    def _size_and_group(self, axis: Axis) -> tuple[int, ProcessGroup]:
        """``(self.size(axis), self.get_group(axis))``, kept per axis (every collective asks;
        raises as they do)."""
        key = (axis, type(axis))
        found = self._axis_groups.get(key)
        if found is None:
            found = self._axis_groups[key] = (self.size(axis), self.get_group(axis))
        return found

    # -- sub-meshes ----------------------------------------------------------------
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of this rank's slice over the named axes (reusing this mesh's groups).

        Example::

            >>> mesh["tp"].mesh.tolist(), mesh["dp", "tp"] == mesh  # rank 1 of (2, 2)
            ([0, 1], True)
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not wanted:
            raise ValueError("DeviceMesh: slicing needs at least one axis name, got ()")
        if self.mesh_dim_names is None:
            raise ValueError(
                f"DeviceMesh: cannot slice by {wanted}: this mesh has no axis names "
                f"(mesh_dim_names=None)"
            )
        unknown = [name for name in wanted if name not in self.mesh_dim_names]
        if unknown:
            raise ValueError(
                f"DeviceMesh: cannot slice by {wanted}: no axis named "
                f"{', '.join(repr(name) for name in unknown)}; mesh axes are {self.mesh_dim_names}"
            )
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"DeviceMesh: slicing names an axis twice: {wanted}")
        cached = self._sub_meshes.get(wanted)
        if cached is not None:
            return cached
        coordinate = self._require_coordinate(f"mesh[{names!r}]")
        kept = [self.mesh_dim_names.index(name) for name in wanted]
        index = tuple(
            slice(None) if axis in kept else coordinate[axis] for axis in range(self.ndim)
        )
        remaining = [axis for axis in range(self.ndim) if axis in kept]
        order = [remaining.index(axis) for axis in kept]
        sub_ranks = self.mesh[index].permute(order).contiguous()
        sub = DeviceMesh.__new__(DeviceMesh)
        groups = {position: self._groups[axis] for position, axis in enumerate(kept)}
        sub._setup(self.device_type, sub_ranks, wanted, self._rank, groups)
        # Held by the parent, so a pickled DTensor of a sub-mesh finds it while the parent lives.
        self._sub_meshes[wanted] = sub
        _remember_mesh(sub)
        return sub

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        """Make this the mesh that DTensor APIs use when none is given, as in torch.

        Example::

            with mesh:
                dt = DTensor.from_local(torch.ones(2), placements=[Replicate()])
        """
        _entered.set((*_entered.get(), self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _entered.get()
        _entered.set(stack[:-1])

    # -- value semantics -------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, object]) -> DeviceMesh:
        return self  # a mesh names process groups, which are shared, never copied

    def __copy__(self) -> DeviceMesh:
        return self

    def __reduce__(self) -> tuple[Callable[..., DeviceMesh], tuple[object, ...]]:
        # Pickled by value, with the rank that pickled it; reattached to this process's
        # mesh of that value (see the module docstring).
        return (
            _rebuild_mesh,
            (self.device_type, self.mesh.tolist(), self.mesh_dim_names, self._rank),
        )

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self._value_hash == other._value_hash and self._value_key == other._value_key

    def __hash__(self) -> int:
        return self._value_hash

    def __repr__(self) -> str:
        names = "" if self.mesh_dim_names is None else f", mesh_dim_names={self.mesh_dim_names}"
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    # -- helpers -------------------------------------------------------------------
    def _names_hint(self) -> str:
        return "" if self.mesh_dim_names is None else f", or a name in {self.mesh_dim_names}"

    def _axis_or_only(self, axis: Axis | None, method: str) -> int:
        if axis is not None:
            return self.axis_index(axis)
        if self.ndim != 1:
            raise ValueError(
                f"DeviceMesh.{method}: axis may be omitted only on a 1-d mesh; this mesh is "
                f"{self.ndim}-d with shape {self.shape}{self._names_hint()}"
            )
        return 0

    def _require_coordinate(self, method: str) -> list[int]:
        if self._coordinate is None:
            raise RuntimeError(
                f"DeviceMesh.{method}: rank {self._rank} is not in this mesh "
                f"(ranks {sorted(self.mesh.flatten().tolist())})"
            )
        return self._coordinate


def _rebuild_mesh(
    device_type: str, ranks: list[Any], mesh_dim_names: tuple[str, ...] | None, rank: int
) -> DeviceMesh:
    """Unpickle a mesh: the live mesh of that value, else a detached one (no groups)."""
    tensor = torch.tensor(ranks, dtype=torch.int64)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    key: MeshKey = (device_type, tuple(tensor.shape), tuple(tensor.flatten().tolist()), names)
    live = _live_meshes.get(key)
    if live is not None:
        return live
    detached = DeviceMesh.__new__(DeviceMesh)
    detached._setup(device_type, tensor, names, rank, groups={})
    return detached


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> DeviceMesh:
    """A mesh of ``mesh_shape`` over all ranks in row-major order (ranks ``0..N-1``).

    Initialises the default process group if needed; the product of ``mesh_shape``
    must equal the world size.

    Example::

        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> mesh.mesh.tolist()
        [[0, 1], [2, 3]]
    """
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(
            f"init_device_mesh: mesh_shape must be a non-empty sequence of positive ints, "
            f"got {mesh_shape!r}"
        )
    _check_names(mesh_dim_names, len(shape))
    platform = get_platform()
    platform.ensure_device_type(device_type)
    if not platform.is_initialized():
        platform.init_process_group(device_type)
    world_size = platform.get_world_size()
    if math.prod(shape) != world_size:
        raise ValueError(
            f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} ranks but the "
            f"world size is {world_size}; expected a shape whose product is {world_size}"
        )
    ranks = torch.arange(world_size, dtype=torch.int64).reshape(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names)


def _alias(axis: Axis | None, dim: Axis | None) -> Axis | None:
    if axis is not None and dim is not None:
        raise TypeError("DeviceMesh: pass axis or dim (its alias), not both")
    return dim if axis is None else axis


def _as_rank_tensor(mesh: Sequence[object] | torch.Tensor) -> torch.Tensor:
    """The mesh as an int64 CPU tensor of ranks, checked for shape."""
    if isinstance(mesh, torch.Tensor):
        if mesh.is_floating_point() or mesh.is_complex() or mesh.dtype == torch.bool:
            raise ValueError(f"DeviceMesh: mesh must hold integer ranks, got dtype {mesh.dtype}")
        ranks = mesh.detach().to(device="cpu", dtype=torch.int64).clone()
    else:
        try:
            ranks = torch.tensor(mesh, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"DeviceMesh: mesh must be a rectangular nested sequence of int ranks, "
                f"got {mesh!r} ({error})"
            ) from error
    if ranks.dim() == 0:
        raise ValueError(f"DeviceMesh: mesh must have at least one axis, got a scalar {mesh!r}")
    if ranks.numel() == 0:
        raise ValueError(
            f"DeviceMesh: every axis must have a positive size, got shape {tuple(ranks.shape)}"
        )
    return ranks


def _check_names(names: tuple[str, ...] | None, ndim: int) -> tuple[str, ...] | None:
    """Validate ``mesh_dim_names`` against the number of axes."""
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(
            f"DeviceMesh: mesh_dim_names {names} has {len(names)} names but the mesh has "
            f"{ndim} axes; expected {ndim} names"
        )
    empty = [index for index, name in enumerate(names) if not isinstance(name, str) or not name]
    if empty:
        raise ValueError(
            f"DeviceMesh: mesh_dim_names must be non-empty strings; {names} has invalid names "
            f"at positions {empty}"
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"DeviceMesh: mesh_dim_names must be distinct; {names} repeats {repeated}")
    return names
