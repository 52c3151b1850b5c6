"""DTensor: a torch.Tensor subclass whose metadata is the global tensor, holding the local shard.

Every op on a DTensor reaches :meth:`DTensor.__torch_dispatch__`, which hands it to
the dispatcher (``_dispatch``); the conversions (``from_local``, ``to_local``,
``redistribute``) are the autograd functions of ``_autograd``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hyper_parallel.dtensor import _checkpointable
from hyper_parallel.dtensor._autograd import FromLocal, Redistribute, ToLocal, ensure_leaf_grad_hook
from hyper_parallel.dtensor._dispatch import Dispatcher
from hyper_parallel.dtensor._rank_check import check_local_shards
from hyper_parallel.dtensor._redistribute import PlacementError, check_redistribute_target
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    check_same_mesh,
    global_strides,
    local_shape_and_offset,
    normalize_placements,
    replicate_all,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.dtensor.placement_types import Placement, Shard, _StridedShard

__all__ = [
    "DTensor",
    "clear_plan_cache",
    "dispatch_by_rules",
    "fallback_counts",
    "plan_cache_size",
    "plan_derivations",
    "reset_fallback_counts",
]


_make_wrapper = torch.Tensor._make_wrapper_subclass


class DTensor(torch.Tensor):
    """A distributed tensor: global shape, stride and dtype; a local shard on each rank.

    Every torch op on DTensors gives the numbers the same op gives on the full
    tensors, forward and backward. Build one with :meth:`from_local` or
    :func:`distribute_tensor`.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        w.shape, w.to_local().shape   # (torch.Size([8, 4]), torch.Size([4, 4]))
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    _hp_grad_hook: RemovableHandle | None
    __slots__ = ("_hp_grad_hook", "_local_tensor", "_spec")

    _op_dispatcher: Dispatcher
    """Runs every op on DTensors: rules, plan cache, fallback counts (set below the class)."""

    @staticmethod
    def __new__(
        cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False
    ) -> DTensor:
        meta = spec.tensor_meta
        # positional (size, strides, storage_offset, memory_format, dtype, layout, device,
        # pin_memory, requires_grad): torch parses them faster than keywords, and every op
        # on DTensors builds one wrapper per result
        r = _make_wrapper(
            cls,
            meta.shape,
            meta.stride,
            None,
            None,
            meta.dtype,
            local_tensor.layout,
            local_tensor.device,
            False,
            requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        # A lazily conjugated (or negated) local makes a lazily conjugated DTensor, as in
        # torch: later ops then see the bit on the wrapper and resolve it, instead of
        # reading the unconjugated memory of the local view. Only a complex tensor can be
        # conjugated lazily (a real one's conj() is itself); a real one can be negated
        # lazily (``z.conj().imag``, ``torch._neg_view``).
        if meta.dtype.is_complex and local_tensor.is_conj():
            torch._C._set_conj(r, True)
        if local_tensor.is_neg():
            torch._C._set_neg(r, True)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    # __torch_dispatch__ is ``_dispatch.torch_dispatch`` as a classmethod: the Dispatcher
    # built for the class (``_op_dispatcher``, below the class) installs it.

    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec, bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor],
        flatten_spec: tuple[DTensorSpec, bool],
        outer_size: Any,
        outer_stride: Any,
    ) -> DTensor:
        spec, requires_grad = flatten_spec
        local = inner_tensors["_local_tensor"]
        meta = TensorMeta(outer_size, outer_stride, local.dtype)
        return DTensor(
            local, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=requires_grad
        )

    # Pickling, deepcopy and DCP's checkpointable protocol live in _checkpointable.
    def __reduce_ex__(self, proto: Any) -> Any:  # type: ignore[override]
        return _checkpointable.reduce_dtensor(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:  # type: ignore[override]
        return _checkpointable.deepcopy_dtensor(self, memo)

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        return _checkpointable.create_write_items(self, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        return _checkpointable.create_chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return _checkpointable.get_tensor_shard(self, index)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        """Set ``requires_grad`` in place; a leaf then lays its gradients out like itself.

        The gradient of a leaf arrives in whatever layout backward produced; a hook lays
        it out like the leaf before it is accumulated into ``.grad``, except that a
        Partial gradient of a Replicate leaf stays Partial, as torch leaves it (reduced
        once, before an optimizer step reads it: ``_partial_grads``).
        ``nn.Parameter(dt)`` goes through here.

        Example::

            w = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]).requires_grad_()
        """
        super().requires_grad_(requires_grad)
        ensure_leaf_grad_hook(self)
        return self

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis."""
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the shards live on."""
        return self._spec.mesh

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap this rank's shard as a DTensor; differentiable.

        Without ``shape``, shards are assumed even (global size = local size x axis
        size). Pass ``shape`` and ``stride`` (both, as torch) for uneven shards. ``run_check=True``
        checks every rank's shard against the others (dtype, requires_grad, placements,
        the dims no axis shards, ``torch.chunk`` shard sizes; the same error on every
        rank), infers an uneven global shape, and broadcasts Replicate values from the
        first rank of each axis. ``device_mesh`` defaults to the mesh of ``with mesh:``,
        ``placements`` to Replicate.

        Example::

            dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # global (4, 4) on 2 ranks
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(
                f"DTensor.from_local: expected a plain torch.Tensor, found {type(local_tensor).__name__}"
            )
        if device_mesh is None:
            device_mesh = current_mesh("DTensor.from_local")
        if placements is None:
            placements = replicate_all(device_mesh.ndim)
        placements_t = normalize_placements(
            placements, device_mesh.ndim, local_tensor.ndim, where="DTensor.from_local"
        )
        if shape is None and stride is None and not run_check:
            # the common call (even shards): its spec is computed once per layout
            spec = _even_spec(
                device_mesh,
                placements_t,
                tuple(local_tensor.shape),
                local_tensor.stride(),
                local_tensor.dtype,
            )
            local_tensor = _off_mesh_empty(local_tensor, device_mesh)
            return FromLocal.apply(local_tensor, spec, False, DTensor)  # type: ignore[no-any-return]
        if (stride is None) != (shape is None):
            # torch's check and words: a shape alone does not say the global strides
            raise PlacementError(
                f"DTensor.from_local: found shape {None if shape is None else tuple(shape)}, "
                f"stride {None if stride is None else tuple(stride)}. Please pass both shape "
                "and stride at the same time."
            )
        if shape is not None:
            global_shape = tuple(int(s) for s in shape)
            if len(global_shape) != local_tensor.ndim:
                raise PlacementError(
                    f"DTensor.from_local: shape {global_shape} has {len(global_shape)} dim(s), "
                    f"the local tensor has {local_tensor.ndim}"
                )
            if stride is not None and len(stride) != len(global_shape):
                raise PlacementError(
                    f"DTensor.from_local: stride {tuple(stride)} has {len(stride)} entries, the "
                    f"global shape {global_shape} has {len(global_shape)} dim(s)"
                )
        if run_check and device_mesh.get_coordinate() is not None:
            # every rank checks every rank's record: the same error everywhere, none hangs
            global_shape = check_local_shards(
                local_tensor, device_mesh, placements_t, None if shape is None else global_shape
            )
        else:
            if shape is None:
                global_shape = _even_global_shape(
                    tuple(local_tensor.shape), device_mesh, placements_t
                )
            problem = _shard_shape_problem(
                tuple(local_tensor.shape), global_shape, device_mesh, placements_t
            )
            if problem is not None:
                raise PlacementError(problem)
        meta = TensorMeta(
            global_shape,
            tuple(stride)
            if stride is not None
            else global_strides(local_tensor.stride(), device_mesh.shape, placements_t),
            local_tensor.dtype,
        )
        spec = DTensorSpec(device_mesh, placements_t, meta)
        local_tensor = _off_mesh_empty(local_tensor, device_mesh)
        return FromLocal.apply(local_tensor, spec, run_check, DTensor)  # type: ignore[no-any-return]

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor; differentiable.

        ``grad_placements`` says how the gradient that flows back into the shard is
        laid out (default: this DTensor's placements).

        Example::

            local = dt.to_local()
        """
        if not torch.is_grad_enabled():
            return self._local_tensor  # as torch: no autograd node, the shard itself
        if grad_placements is not None:
            grad_placements = normalize_placements(
                grad_placements, self._spec.mesh.ndim, self.ndim, where="DTensor.to_local"
            )
        return ToLocal.apply(self, grad_placements)  # type: ignore[no-any-return]

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global tensor with other placements; differentiable.

        As in torch, ``forward_dtype`` casts the shard before the collective (the result
        has that dtype); ``backward_dtype`` casts the gradient before the backward
        collective, after which it returns to this DTensor's dtype. ``async_op=True``
        issues the collectives and returns at once: the result's local shard (an
        ``AsyncCollectiveTensor``, as in torch) is waited for by the first op that reads
        it, so work placed in between overlaps the communication.

        Example::

            full = dt.redistribute(placements=[Replicate()])
            pending = dt.redistribute(placements=[Replicate()], async_op=True)
            low = dt.redistribute(placements=[Replicate()], forward_dtype=torch.bfloat16)
        """
        mesh = self._spec.mesh
        if device_mesh is not None:
            check_same_mesh(device_mesh, mesh, where="DTensor.redistribute")
        if placements is None:
            raise PlacementError("DTensor.redistribute: placements are required")
        dst = normalize_placements(placements, mesh.ndim, self.ndim, where="DTensor.redistribute")
        check_redistribute_target(self._spec.placements, dst, where="DTensor.redistribute")
        cast = forward_dtype is not None and forward_dtype != self.dtype
        if dst == self._spec.placements and not cast and backward_dtype is None:
            return self
        return Redistribute.apply(self, dst, forward_dtype, backward_dtype, bool(async_op))  # type: ignore[no-any-return]

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor; differentiable.

        Example::

            full = dt.full_tensor()
        """
        replicated = self.redistribute(placements=replicate_all(self._spec.mesh.ndim))
        return replicated.to_local(grad_placements=grad_placements)


def _off_mesh_empty(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """As torch: a rank outside the mesh holds an empty local tensor, whatever it passed."""
    if mesh.get_coordinate() is not None:
        return local
    return local.new_empty(0)


# DTensor.__new__ is the plain wrapper constructor: the dispatcher may build results inline
DTensor.__new__._hp_plain_wrapper = True  # type: ignore[attr-defined]
DTensor._op_dispatcher = Dispatcher(DTensor)


def dispatch_by_rules(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``func`` on DTensors through its sharding rule, bypassing its special (for specials).

    Example::

        dispatch_by_rules(torch.ops.aten.copy_.default, (dst, src), {})
    """
    return DTensor._op_dispatcher.dispatch(func, args, kwargs, specials=False)


def fallback_counts() -> dict[str, int]:
    """How many times each op has fallen back since the process started (or the last reset).

    Example::

        before = fallback_counts()
    """
    return dict(DTensor._op_dispatcher.fallbacks)


def reset_fallback_counts() -> None:
    """Forget the fallback counts.

    Example::

        reset_fallback_counts(); y = torch.sort(dt); fallback_counts()  # {'aten.sort.default': 1}
    """
    DTensor._op_dispatcher.fallbacks.clear()


def clear_plan_cache() -> None:
    """Forget every cached sharding decision.

    Example::

        clear_plan_cache(); plan_cache_size()  # 0
    """
    DTensor._op_dispatcher.clear_plan_cache()


def plan_cache_size() -> int:
    """Number of cached sharding decisions.

    Example::

        n = plan_cache_size(); dt + dt; dt + dt; plan_cache_size() - n  # at most 1
    """
    return DTensor._op_dispatcher.plan_cache_size()


def plan_derivations() -> int:
    """How many sharding decisions were derived (cache misses) since the process started.

    Example::

        n = plan_derivations(); dt + dt; dt + dt; plan_derivations() - n  # 1 (or 0 if cached)
    """
    return DTensor._op_dispatcher.derivations


def _even_global_shape(
    local_shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    """The global shape of even shards: each sharded dim times its axes' sizes."""
    sizes = list(local_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            sizes[p.dim] *= mesh.size(axis)
    return tuple(sizes)


def _shard_shape_problem(
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> str | None:
    """Why this rank's shard cannot be its piece of ``global_shape`` (None when it can)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    expected, _ = local_shape_and_offset(global_shape, mesh.shape, coordinate, placements)
    if local_shape == expected:
        return None
    return (
        f"DTensor.from_local: with global shape {global_shape} and placements "
        f"{placements}, rank {mesh.get_rank()} (mesh coordinate {coordinate}) must hold a "
        f"shard of shape {expected} (torch.chunk layout), found {local_shape}; pass shape= "
        "for uneven shards"
    )


@functools.lru_cache(maxsize=4096)
def _even_spec(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    local_shape: tuple[int, ...],
    local_strides: tuple[int, ...],
    dtype: torch.dtype,
) -> DTensorSpec:
    """The spec ``from_local`` gives even shards of ``local_shape`` (raises when they cannot be).

    The global strides follow the local tensor's memory order, as torch's.
    """
    global_shape = _even_global_shape(local_shape, mesh, placements)
    problem = _shard_shape_problem(local_shape, global_shape, mesh, placements)
    if problem is not None:
        raise PlacementError(problem)
    meta = TensorMeta(global_shape, global_strides(local_strides, mesh.shape, placements), dtype)
    return DTensorSpec(mesh, placements, meta)
