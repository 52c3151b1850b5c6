"""``ParallelDims``: parallelism degrees in, one validated world mesh and its named views out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from hyper_parallel.dmodule.types import NamedPlacement, axis_name
from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.platform import get_platform

__all__ = ["EXPERT_AXES", "ParallelDims"]

#: The axes of the world mesh, slowest first: ranks are laid out row-major, ``tp`` fastest.
WORLD_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: Axes only the expert view has: naming one puts a state (or a boundary) on that view.
EXPERT_AXES: frozenset[str] = frozenset({"ep", "efsdp", "etp"})

# Each view family is one DeviceMesh over every rank, its axes in row-major order (sizes of
# 1 kept, so that a layout naming a disabled axis still resolves); a view is a slice of it.
# name -> the world axes whose ranks the family's flattened axis covers.
_FLATTENED: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "fsdp": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Parallelism degrees, validated, and the meshes they make (TorchTitan's ``ParallelDims``).

    ``-1`` for ``dp_shard`` means "the rest of the world"; ``world_size=None`` reads the
    initialised process group's. The world mesh lays ranks out row-major over
    (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), ``tp`` fastest, with axes of
    size 1 left out. Its named views (each a :class:`DeviceMesh` of this rank's slice):

    - dense: ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (dense weights, activations);
    - expert: ``dp_replicate``, ``efsdp``, ``ep``, ``etp``: the ranks of ``dp_shard`` x
      ``cp`` (x ``tp`` when ``etp == 1``) refactored as ``efsdp`` x ``ep``, ``ep`` fastest;
      ``etp`` holds ``tp``'s ranks;
    - batch: ``batch`` = ``dp_replicate`` x ``dp_shard`` (the ranks that read different data);
    - loss: ``loss`` = batch x ``cp`` (the ranks a loss is averaged over);
    - ``fsdp`` = ``dp_shard`` x ``cp`` (what dense ``fully_shard`` shards over, with
      ``dp_replicate`` for HSDP) and ``efsdp`` (the same for expert weights).

    Frozen: the degrees and the meshes built from them stay together (assigning
    ``dims.tp = 4`` raises ``dataclasses.FrozenInstanceError``); make another with
    ``dataclasses.replace(dims, tp=4, dp_shard=-1)``, whose meshes are built anew.

    Example::

        >>> dims = ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4)
        >>> dims.efsdp, dims.dp
        (2, 2)
        >>> mesh = dims.build_mesh("cpu")        # doctest: +SKIP  (collective)
        >>> mesh.mesh_dim_names                  # doctest: +SKIP
        ('dp_shard', 'tp')
        >>> dims.get_mesh(("efsdp", "ep")).mesh.tolist()   # on rank 0  # doctest: +SKIP
        [[0, 1], [2, 3]]
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int | None = None
    _families: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _world: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        degrees = self._degrees()
        for name, value in degrees.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"ParallelDims: {name} must be an int, found {value!r}")
            if value < 1 and not (name == "dp_shard" and value == -1):
                allowed = "a positive int or -1 (the rest of the world)"
                raise ValueError(
                    f"ParallelDims: {name} must be "
                    f"{allowed if name == 'dp_shard' else 'a positive int'}, found {value}"
                )
        world = self.world_size
        if world is None:
            platform = get_platform()
            if not platform.is_initialized():
                raise ValueError(
                    "ParallelDims: world_size=None reads the process group's world size, but "
                    "torch.distributed is not initialised; pass world_size= or initialise it"
                )
            world = platform.get_world_size()
        elif isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"ParallelDims: world_size must be a positive int, found {world!r}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if world % others:
                raise ValueError(
                    f"ParallelDims: dp_shard=-1 takes the rest of the world, but world size "
                    f"{world} does not divide by dp_replicate*cp*tp*pp = {self.dp_replicate}*"
                    f"{self.cp}*{self.tp}*{self.pp} = {others}"
                )
            object.__setattr__(self, "dp_shard", world // others)
        product = others * self.dp_shard
        if product != world:
            raise ValueError(
                f"ParallelDims: pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*"
                f"{self.dp_shard}*{self.cp}*{self.tp} = {product}, but the world size is {world}; "
                "expected the degrees' product to equal the world size"
            )
        object.__setattr__(self, "world_size", world)
        if self.etp not in (1, self.tp):
            raise ValueError(f"ParallelDims: etp must be 1 or tp ({self.tp}), found etp={self.etp}")
        pool = self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
        if pool % self.ep:
            factors = "dp_shard*cp" + ("*tp" if self.etp == 1 else "")
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide {factors} = {pool} (dp_shard="
                f"{self.dp_shard}, cp={self.cp}, tp={self.tp}, etp={self.etp}): expert "
                "parallelism borrows its ranks from data and context parallelism"
                + (" and from tp when etp == 1" if self.etp == 1 else "")
            )

    def _degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
            "etp": self.etp,
        }

    # -- derived degrees -----------------------------------------------------------

    @property
    def dp(self) -> int:
        """Ranks that read different data: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Expert data-parallel degree: ``dp_shard * cp * tp / (ep * etp)``."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether dense weights are sharded over ``dp_shard`` x ``cp``."""
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    def axis_sizes(self) -> dict[str, int]:
        """Every axis a view can have, with its size (disabled axes have size 1).

        Example::

            >>> ParallelDims(dp_shard=2, tp=2, world_size=4).axis_sizes()["efsdp"]
            4
        """
        sizes = {name: size for name, size in self._degrees().items() if name not in ("ep", "etp")}
        sizes.update(ep=self.ep, etp=self.etp, efsdp=self.efsdp)
        for flat, parts in _FLATTENED.items():
            sizes[flat] = math.prod(sizes[part] for part in parts)
        return sizes

    # -- meshes --------------------------------------------------------------------

    def _family_factors(self) -> dict[str, tuple[tuple[str, int], ...]]:
        size = self.axis_sizes()
        return {
            "world": tuple((name, size[name]) for name in WORLD_AXES),
            "expert": (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("efsdp", self.efsdp),
                ("ep", self.ep),
                ("etp", self.etp),
            ),
            "batch": (("pp", self.pp), ("batch", size["batch"]), ("cp", self.cp), ("tp", self.tp)),
            "loss": (("pp", self.pp), ("loss", size["loss"]), ("tp", self.tp)),
            "fsdp": (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("fsdp", size["fsdp"]),
                ("tp", self.tp),
            ),
        }

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """Build the world mesh and every view (collective: every rank calls it); idempotent.

        ``device_type`` defaults to ``"cpu"`` (later calls: to the one built). Every view
        is built here, in the same order on every rank, so that asking for one
        later is never a collective. A second call returns the same meshes.

        Example::

            >>> mesh = ParallelDims(tp=2).build_mesh("cpu")   # doctest: +SKIP
        """
        if self._world is not None:
            if device_type is not None and device_type != self._world.device_type:
                raise ValueError(
                    f"ParallelDims.build_mesh: the meshes were built for device type "
                    f"{self._world.device_type!r}; asked again for {device_type!r}"
                )
            return self._world
        platform = get_platform()
        kind = device_type or "cpu"
        if not platform.is_initialized():
            platform.init_process_group(kind)
        actual = platform.get_world_size()
        if actual != self.world_size:
            raise ValueError(
                f"ParallelDims.build_mesh: the degrees make a world of {self.world_size} ranks, "
                f"but the process group has {actual}; expected them to be equal"
            )
        ranks = torch.arange(actual, dtype=torch.int64)
        families: dict[str, DeviceMesh] = {}
        for family, factors in self._family_factors().items():
            names = tuple(name for name, _ in factors)
            shape = tuple(n for _, n in factors)
            families[family] = DeviceMesh(kind, ranks.reshape(shape), mesh_dim_names=names)
        enabled = tuple(name for name, n in self._family_factors()["world"] if n > 1)
        # the built meshes are a cache of the degrees, not a degree: set past the freeze
        world = families["world"][enabled or ("dp_shard",)]
        object.__setattr__(self, "_families", families)
        object.__setattr__(self, "_world", world)
        return world

    @property
    def is_built(self) -> bool:
        """Whether :meth:`build_mesh` has run."""
        return self._world is not None

    def _built(self) -> dict[str, DeviceMesh]:
        if self._world is None:
            self.build_mesh()
        return self._families

    @property
    def world_mesh(self) -> DeviceMesh:
        """The world mesh over the enabled axes (built on first use)."""
        self._built()
        assert self._world is not None
        return self._world

    @property
    def dense_mesh(self) -> DeviceMesh:
        """``dp_replicate`` x ``dp_shard`` x ``cp`` x ``tp`` (sizes of 1 kept)."""
        return self.get_mesh(("dp_replicate", "dp_shard", "cp", "tp"))

    @property
    def expert_mesh(self) -> DeviceMesh:
        """``dp_replicate`` x ``efsdp`` x ``ep`` x ``etp`` (sizes of 1 kept)."""
        return self.get_mesh(("dp_replicate", "efsdp", "ep", "etp"))

    @property
    def batch_mesh(self) -> DeviceMesh:
        """The 1-D ``batch`` view: the ranks that read different data."""
        return self.get_mesh("batch")

    @property
    def loss_mesh(self) -> DeviceMesh:
        """The 1-D ``loss`` view: batch x ``cp``, the ranks a mean loss spans."""
        return self.get_mesh("loss")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What dense ``fully_shard`` shards over: ``fsdp``, with ``dp_replicate`` for HSDP."""
        if self.dp_replicate_enabled:
            return self.get_mesh(("dp_replicate", "fsdp"))
        return self.get_mesh("fsdp")

    @property
    def efsdp_mesh(self) -> DeviceMesh:
        """What expert ``fully_shard`` shards over: ``efsdp``, with ``dp_replicate`` for HSDP."""
        if self.dp_replicate_enabled:
            return self.get_mesh(("dp_replicate", "efsdp"))
        return self.get_mesh("efsdp")

    def get_mesh(self, axes: str | Iterable[str]) -> DeviceMesh:
        """The view holding exactly ``axes``, in the order given (builds the meshes if needed).

        Example::

            >>> dims.get_mesh("tp"), dims.get_mesh(("dp_shard", "tp"))  # doctest: +SKIP
        """
        wanted = (axes,) if isinstance(axes, str) else tuple(axis_name(a) for a in axes)
        families = self._built()
        for family in families.values():
            names = family.mesh_dim_names or ()
            if all(name in names for name in wanted):
                return family[wanted]
        known = sorted(self.axis_sizes())
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise ValueError(
                f"ParallelDims.get_mesh: no view has axis {', '.join(map(repr, unknown))}; "
                f"the axes are {known}"
            )
        raise ValueError(
            f"ParallelDims.get_mesh: no single view holds all of {wanted}: expert axes "
            f"({', '.join(sorted(EXPERT_AXES))}) and the flattened axes "
            f"({', '.join(_FLATTENED)}) live on views of their own"
        )

    def view_for(self, named: NamedPlacement | Iterable[str]) -> DeviceMesh:
        """The view a layout naming these axes lives on: its axes in the view's order.

        A layout naming ``ep``, ``efsdp`` or ``etp`` lives on the expert view, others on the
        dense view; it names no axis: the dense view (replicated on all of it).

        Example::

            >>> dims.view_for({"ep": Shard(0)}).mesh_dim_names   # doctest: +SKIP
            ('ep',)
        """
        names = [axis_name(a) for a in (named.keys() if isinstance(named, Mapping) else named)]
        if not names:
            return self.dense_mesh
        families = self._built()
        for family in families.values():
            order = family.mesh_dim_names or ()
            if all(name in order for name in names):
                return family[tuple(sorted(set(names), key=order.index))]
        return self.get_mesh(names)  # raises, naming the axis no view has
