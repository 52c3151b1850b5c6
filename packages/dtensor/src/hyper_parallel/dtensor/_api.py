"""DTensor: a torch.Tensor subclass whose metadata is the global tensor, holding the local shard."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from hyper_parallel.dtensor import _comm_log
from hyper_parallel.dtensor._redistribute import check_redistribute_target, redistribute_local
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    chunk_bounds,
    local_shape_and_offset,
    normalize_placements,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

__all__ = ["DTensor", "distribute_tensor", "enforce_layout"]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    return _contiguous_strides(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


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

    _dispatch_hook: ClassVar[Any] = None

    @staticmethod
    def __new__(
        cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False
    ) -> DTensor:
        meta = spec.tensor_meta
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            dtype=meta.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return cls._dispatch_hook(func, args, kwargs or {})

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

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    def requires_grad_(self, requires_grad: bool = True) -> DTensor:
        """Set ``requires_grad`` in place; a leaf then lays its gradients out like itself.

        The gradient of a leaf arrives in whatever layout backward produced (a
        replicated weight used with sharded activations gets a Partial gradient); a
        hook redistributes it to the leaf's placements (Partial becoming Replicate)
        before it is accumulated into ``.grad``, so optimizers see matching layouts.
        ``nn.Parameter(dt)`` goes through here.

        Example::

            w = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]).requires_grad_()
        """
        super().requires_grad_(requires_grad)
        _ensure_leaf_grad_hook(self)
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
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap this rank's shard as a DTensor; differentiable.

        Without ``shape``, shards are assumed even (global size = local size x axis
        size). Pass ``shape`` (and ``stride``) for uneven shards, or ``run_check=True``
        to check the shards' shapes across ranks (and broadcast Replicate values
        from the first rank of each axis).

        Example::

            dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])  # global (4, 4) on 2 ranks
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(
                f"DTensor.from_local: expected a plain torch.Tensor, found {type(local_tensor).__name__}"
            )
        placements_t = normalize_placements(
            placements, device_mesh.ndim, local_tensor.ndim, where="DTensor.from_local"
        )
        if shape is None:
            if run_check:
                global_shape = _global_shape_from_shards(local_tensor, device_mesh, placements_t)
            else:
                sizes = list(local_tensor.shape)
                for axis, p in enumerate(placements_t):
                    if isinstance(p, Shard):
                        sizes[p.dim] *= device_mesh.size(axis)
                global_shape = tuple(sizes)
        else:
            global_shape = tuple(int(s) for s in shape)
            if len(global_shape) != local_tensor.ndim:
                raise ValueError(
                    f"DTensor.from_local: shape {global_shape} has {len(global_shape)} dim(s), "
                    f"the local tensor has {local_tensor.ndim}"
                )
        if stride is not None and len(stride) != len(global_shape):
            raise ValueError(
                f"DTensor.from_local: stride {tuple(stride)} has {len(stride)} entries, the "
                f"global shape {global_shape} has {len(global_shape)} dim(s)"
            )
        coordinate = device_mesh.get_coordinate()
        problem = None
        if coordinate is not None:
            expected, _ = local_shape_and_offset(
                global_shape, device_mesh.shape, coordinate, placements_t
            )
            if tuple(local_tensor.shape) != expected:
                problem = (
                    f"DTensor.from_local: with global shape {global_shape} and placements "
                    f"{placements_t}, rank {device_mesh.get_rank()} (mesh coordinate "
                    f"{coordinate}) must hold a shard of shape {expected} (torch.chunk "
                    f"layout), found {tuple(local_tensor.shape)}; pass shape= for uneven shards"
                )
        # Under run_check every rank learns whether any rank failed, so none is left waiting.
        if (
            run_check
            and coordinate is not None
            and _any_rank_in_mesh(problem is not None, device_mesh, local_tensor.device)
            and problem is None
        ):
            raise ValueError(
                "DTensor.from_local(run_check=True): another rank's local tensor does not "
                f"fit global shape {global_shape} with placements {placements_t} (see the "
                "error on that rank)"
            )
        if problem is not None:
            raise ValueError(problem)
        meta = TensorMeta(
            global_shape,
            tuple(stride) if stride is not None else contiguous_strides(global_shape),
            local_tensor.dtype,
        )
        spec = DTensorSpec(device_mesh, placements_t, meta)
        # The broadcast runs inside the autograd Function, so gradients still reach the input.
        return _FromLocal.apply(local_tensor, spec, run_check)  # type: ignore[no-any-return]

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor; differentiable.

        ``grad_placements`` says how the gradient that flows back into the shard is
        laid out (default: this DTensor's placements).

        Example::

            local = dt.to_local()
        """
        if grad_placements is not None:
            grad_placements = normalize_placements(
                grad_placements, self._spec.mesh.ndim, self.ndim, where="DTensor.to_local"
            )
        return _ToLocal.apply(self, grad_placements)  # type: ignore[no-any-return]

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """The same global tensor with other placements; differentiable.

        Example::

            full = dt.redistribute(placements=[Replicate()])
        """
        mesh = self._spec.mesh
        if device_mesh is not None:
            check_same_mesh(device_mesh, mesh, where="DTensor.redistribute")
        if placements is None:
            raise ValueError("DTensor.redistribute: placements are required")
        dst = normalize_placements(placements, mesh.ndim, self.ndim, where="DTensor.redistribute")
        check_redistribute_target(self._spec.placements, dst, where="DTensor.redistribute")
        if dst == self._spec.placements:
            return self
        return _Redistribute.apply(self, dst)  # type: ignore[no-any-return]

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor; differentiable.

        Example::

            full = dt.full_tensor()
        """
        replicated = self.redistribute(placements=(Replicate(),) * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)


def enforce_layout(dt: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Redistribute ``dt`` to ``placements`` and lay its gradient out the same way in backward.

    Unlike :meth:`DTensor.redistribute`, it records a node even when nothing moves, so
    a Partial gradient arriving from later ops is reduced here. That is what a module
    boundary with declared input placements needs: Megatron's "copy to parallel
    region" for a replicated block input, whose gradient is all-reduced once at the
    boundary instead of travelling on as partial sums.

    Example::

        x = enforce_layout(x, [Replicate()])   # forward: nothing moves; backward: one all-reduce
    """
    mesh = dt._spec.mesh
    dst = normalize_placements(placements, mesh.ndim, dt.ndim, where="enforce_layout")
    check_redistribute_target(dt._spec.placements, dst, where="enforce_layout")
    return _Redistribute.apply(dt, dst)  # type: ignore[no-any-return]


def _global_shape_from_shards(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    """Global shape from every rank's shard sizes (gathered along each sharding axis)."""
    platform = get_platform()
    sizes = list(local.shape)
    for axis in reversed(range(mesh.ndim)):
        p = placements[axis]
        if not isinstance(p, Shard):
            continue
        mine = torch.tensor([sizes[p.dim]], dtype=torch.int64, device=local.device)
        gathered = platform.all_gather(mine, mesh.get_group(axis))
        _comm_log.record("all_gather", mine, mesh.size(axis))
        sizes[p.dim] = int(gathered.sum().item())
    return tuple(sizes)


def _any_rank_in_mesh(flag: bool, mesh: DeviceMesh, device: torch.device) -> bool:
    """True on every rank of ``mesh`` when ``flag`` is true on any of them (collective)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    return bool(_comm_log.all_reduce_over(value, groups, "max").item())


def _broadcast_replicated(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    platform = get_platform()
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Replicate) and spec.mesh.size(axis) > 1:
            local = platform.broadcast(local, spec.mesh.get_group(axis), 0)
            _comm_log.record("broadcast", local, spec.mesh.size(axis))
    return local


def _grad_target(
    forward: tuple[Placement, ...], grad: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """Where the gradient of a redistribute input goes in backward (torch DTensor's rule).

    The forward input's layout, except that a gradient which is not Partial is not
    turned back into the Partial of the forward value: it stays Replicate. So a
    Partial gradient of a Shard or Replicate input is reduced here.
    """
    target: list[Placement] = []
    for fwd, cur in zip(forward, grad, strict=True):
        if fwd.is_partial() and not cur.is_partial():
            target.append(Replicate())
        else:
            target.append(fwd)
    return tuple(target)


def _grad_placements_of(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The layout of the gradient of a value laid out as ``placements``: Partial becomes Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _leaf_grad_hook(spec: DTensorSpec) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A gradient hook that lays an incoming gradient out like a leaf of layout ``spec``.

    It holds the leaf's spec, not the leaf: no reference cycle, and no weak
    reference (which ``torch.utils.swap_tensors``, used by ``Module.to_empty``, refuses).
    """
    target = _grad_placements_of(spec.placements)

    def to_leaf_layout(grad: torch.Tensor) -> torch.Tensor | None:
        grad_dt = _as_dtensor_grad(grad, spec)
        if grad_dt._spec.placements == target and grad_dt is grad:
            return None  # already laid out like the leaf: nothing to do
        check_same_mesh(grad_dt._spec.mesh, spec.mesh, where="DTensor gradient hook")
        local = redistribute_local(grad_dt._local_tensor, grad_dt._spec, target)
        return DTensor(local, grad_dt._spec.with_placements(target))

    return to_leaf_layout


def _ensure_leaf_grad_hook(dt: DTensor) -> None:
    """Register the layout hook on a leaf that requires grad, once per tensor object."""
    if dt.is_leaf and dt.requires_grad and getattr(dt, "_hp_grad_hook", None) is None:
        dt._hp_grad_hook = dt.register_hook(_leaf_grad_hook(dt._spec))  # type: ignore[no-untyped-call]


def check_same_mesh(found: DeviceMesh, expected: DeviceMesh, *, where: str) -> None:
    """Raise ``ValueError`` unless ``found`` is ``expected`` (moving between meshes is unsupported)."""
    if found != expected:
        raise ValueError(
            f"{where}: moving between meshes is not supported; the tensor is on {expected}, "
            f"found {found}"
        )


def _as_dtensor_grad(grad: torch.Tensor, like: DTensorSpec) -> DTensor:
    """A gradient as a DTensor: a plain one of global shape is taken as replicated."""
    if isinstance(grad, DTensor):
        return grad
    if tuple(grad.shape) == like.shape:
        return DTensor(grad, like.with_placements((Replicate(),) * like.mesh.ndim))
    return DTensor(grad, like)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, spec: DTensorSpec, run_check: bool
    ) -> DTensor:
        ctx.spec = spec
        value = _broadcast_replicated(local, spec) if run_check else local
        if value is local:
            value = local.view_as(local)
        return DTensor(value, spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        spec: DTensorSpec = ctx.spec
        grad_dt = _as_dtensor_grad(grad, spec)
        target = _grad_placements_of(spec.placements)
        local = redistribute_local(grad_dt._local_tensor, grad_dt._spec, target)
        return local, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dt: DTensor, grad_placements: tuple[Placement, ...] | None
    ) -> torch.Tensor:
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        local = dt._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:  # type: ignore[override]
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        meta = TensorMeta(spec.shape, contiguous_strides(spec.shape), grad.dtype)
        return DTensor(grad, DTensorSpec(spec.mesh, placements, meta)), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, dst: tuple[Placement, ...]) -> DTensor:  # type: ignore[override]
        src_spec = dt._spec
        ctx.src_spec = src_spec
        local = redistribute_local(dt._local_tensor, src_spec, dst)
        if local is dt._local_tensor:
            local = local.view_as(local)
        return DTensor(local, src_spec.with_placements(dst), requires_grad=dt.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:  # type: ignore[override]
        src_spec: DTensorSpec = ctx.src_spec
        grad_dt = _as_dtensor_grad(grad, src_spec)
        target = _grad_target(src_spec.placements, grad_dt._spec.placements)
        local = redistribute_local(grad_dt._local_tensor, grad_dt._spec, target)
        return DTensor(local, grad_dt._spec.with_placements(target)), None


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay a full tensor out over ``device_mesh``: a leaf DTensor holding this rank's shard.

    With ``src_data_rank=k`` the values come from global rank ``k`` (scattered
    along sharded axes, broadcast along replicated ones); with ``None`` every rank
    slices its own copy, with no communication.

    Example::

        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor: the input is already a DTensor; use .redistribute()")
    if placements is None:
        placements = (Replicate(),) * device_mesh.ndim
    placements_t = normalize_placements(
        placements, device_mesh.ndim, tensor.ndim, where="distribute_tensor"
    )
    for axis, p in enumerate(placements_t):
        if isinstance(p, Partial):
            raise ValueError(
                f"distribute_tensor: mesh axis {axis}: cannot distribute into {p!r}; a full "
                "tensor is laid out with Shard(dim) or Replicate()"
            )
    world = device_mesh.mesh.flatten().tolist()
    if src_data_rank is not None and src_data_rank not in world:
        raise ValueError(
            f"distribute_tensor: src_data_rank={src_data_rank} is not a rank of the mesh "
            f"(ranks {world})"
        )
    meta = TensorMeta(tensor.shape, contiguous_strides(tensor.shape), tensor.dtype)
    spec = DTensorSpec(device_mesh, placements_t, meta)
    coordinate = device_mesh.get_coordinate()
    data = tensor.detach()
    if coordinate is None:
        local = data.new_empty(0)
    elif src_data_rank is None:
        local = _local_slice(data, device_mesh, coordinate, placements_t)
    else:
        local = _scatter_from(data, device_mesh, coordinate, placements_t, src_data_rank)
    result = DTensor(local, spec, requires_grad=tensor.requires_grad)
    _ensure_leaf_grad_hook(result)
    return result


def _local_slice(
    full: torch.Tensor, mesh: DeviceMesh, coordinate: Sequence[int], placements: Sequence[Placement]
) -> torch.Tensor:
    shape, offset = local_shape_and_offset(full.shape, mesh.shape, coordinate, placements)
    local = full
    for dim, (start, length) in enumerate(zip(offset, shape, strict=True)):
        if length != full.shape[dim]:
            local = local.narrow(dim, start, length)
    return local.clone(memory_format=torch.contiguous_format)


def _scatter_from(
    full: torch.Tensor,
    mesh: DeviceMesh,
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    src_rank: int,
) -> torch.Tensor:
    """Scatter/broadcast axis by axis from ``src_rank``'s copy of ``full``.

    After axis ``i``, every rank whose coordinates on the later axes equal the
    source's holds its piece; each axis's group then forwards it one step.
    """
    platform = get_platform()
    src_coord = [int(c) for c in (mesh.mesh == src_rank).nonzero()[0].tolist()]
    piece = full.contiguous()
    for axis, p in enumerate(placements):
        n = mesh.size(axis)
        if n == 1:
            continue
        if any(coordinate[j] != src_coord[j] for j in range(axis + 1, mesh.ndim)):
            continue  # this rank's group along `axis` holds no data yet; a later axis brings it
        group = mesh.get_group(axis)
        root = src_coord[axis]
        r = coordinate[axis]
        outer = [q if j < axis else Replicate() for j, q in enumerate(placements)]
        shape, _ = local_shape_and_offset(full.shape, mesh.shape, coordinate, outer)
        if isinstance(p, Shard):
            bounds = chunk_bounds(shape[p.dim], n)
            full_len = bounds[1] - bounds[0]
            like_shape = list(shape)
            like_shape[p.dim] = full_len
            chunks = None
            if r == root:
                chunks = [
                    _pad_to(
                        piece.narrow(p.dim, bounds[k], bounds[k + 1] - bounds[k]), p.dim, full_len
                    )
                    for k in range(n)
                ]
            received = platform.scatter(chunks, piece.new_empty(like_shape), group, root)
            _comm_log.record("scatter", received, n)
            piece = received.narrow(p.dim, 0, bounds[r + 1] - bounds[r]).contiguous()
        else:
            buffer = piece if r == root else piece.new_empty(shape)
            piece = platform.broadcast(buffer, group, root)
            _comm_log.record("broadcast", piece, n)
    if piece.data_ptr() == full.data_ptr() or piece is full:
        piece = piece.clone()
    return piece


def _pad_to(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t.contiguous()
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
