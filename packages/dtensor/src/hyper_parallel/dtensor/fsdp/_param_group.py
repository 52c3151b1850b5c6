"""One ``fully_shard`` group: its parameters' shards, one all-gather, one reduce-scatter.

A parameter's *unsharded local* tensor is what one data-parallel rank would hold
without FSDP: the full parameter, or its TP shard. FSDP chunks it along the shard dim
with ``torch.chunk``'s rule (the trailing ranks are short or empty) over the mesh's
shard axis. Each rank pads its chunk to the first chunk's size, and the group's padded
chunks, flattened and concatenated, are the one buffer every collective moves:

- unshard: one ``all_gather`` of the padded buffer over the shard axis, cut back into
  each parameter's unsharded local tensor;
- gradients: one ``reduce_scatter`` of the stacked padded gradients over the shard
  axis in ``reduce_dtype`` (plus one ``all_reduce`` over the replicate axis for HSDP).

Every collective goes through :mod:`hyper_parallel.dtensor.collectives`, so
``CommDebugMode`` counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._partial_grads import all_reduce_together, leaf_grad_placements
from hyper_parallel.dtensor._spec import chunk_range
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.fsdp._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard, _StridedShard

__all__ = ["FSDPParam", "FSDPParamGroup", "MeshInfo", "Slot"]


@dataclass(frozen=True)
class Slot:
    """Where a parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel mesh of a group: its shard axis and, for HSDP, its replicate axis."""

    mesh: DeviceMesh
    shard_axis: int
    replicate_axis: int | None

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_axis)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)

    def axis_name(self, axis: int) -> str | None:
        names = self.mesh.mesh_dim_names
        return None if names is None else names[axis]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    wanted = t.numel() * t.element_size()
    if storage.size() != wanted:
        storage.resize_(wanted)


class FSDPParam:
    """One managed parameter: its sharded DTensor parameter and its unsharded parameter.

    Example::

        p = FSDPParam(module.weight, [Slot(module, "weight")], mesh_info, 0, device, ...)
        p.sharded_param.placements   # (Shard(dim=0),)
    """

    def __init__(
        self,
        param: nn.Parameter,
        slots: list[Slot],
        info: MeshInfo,
        shard_dim: int,
        device: torch.device,
        spmd: tuple[DeviceMesh, tuple[Placement, ...]],
        mp: MixedPrecisionPolicy,
        offload: OffloadPolicy,
        fqn: str,
    ) -> None:
        self.slots = slots
        self.fqn = fqn
        self.info = info
        self.dim = shard_dim
        self.device = device
        self.requires_grad = param.requires_grad
        self.orig_dtype = param.dtype
        self.param_dtype = mp.param_dtype or param.dtype
        self.offload = isinstance(offload, CPUOffloadPolicy)
        if isinstance(param, DTensor):
            spec = param._spec
            self.tp_mesh: DeviceMesh | None = spec.mesh
            self.tp_placements: tuple[Placement, ...] = spec.placements
            unsharded_local = param._local_tensor
        else:
            self.tp_mesh = None
            self.tp_placements = ()
            unsharded_local = param.detach()
        self.global_shape = tuple(param.shape)
        self.unsharded_shape = tuple(unsharded_local.shape)
        size = info.shard_size
        length = self.unsharded_shape[shard_dim]
        self.chunk = math.ceil(length / size) if length else 0
        self.chunk_shape = tuple(
            self.chunk if d == shard_dim else s for d, s in enumerate(self.unsharded_shape)
        )
        self.chunk_numel = math.prod(self.chunk_shape)
        rank = info.mesh.get_local_rank(info.shard_axis)
        start = min(rank * self.chunk, length)
        self.local_length = max(0, min(self.chunk, length - rank * self.chunk))
        self.spmd_mesh, self.spmd_placements = spmd
        local = unsharded_local.detach().narrow(shard_dim, start, self.local_length)
        target = torch.device("cpu") if self.offload else device
        if local.device.type != "meta":
            local = local.to(target)
            if self.offload and getattr(offload, "pin_memory", False) and device.type != "cpu":
                local = local.pin_memory()
        local = local.clone(memory_format=torch.contiguous_format)
        self.sharded_param = nn.Parameter(self._wrap_sharded(local), self.requires_grad)
        self.unsharded_param: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None  # unreduced grads (no gradient sync)
        # the TP axes (and reduce ops) on which the unsharded gradient is still Partial: it is
        # reduced after the reduce-scatter, on this rank's chunk, once per synced backward
        self.tp_partial: tuple[tuple[int, str], ...] = ()

    # -- layouts -------------------------------------------------------------------
    def _wrap_sharded(self, local: torch.Tensor) -> DTensor:
        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.spmd_mesh,
                self.spmd_placements,
                shape=self.global_shape,
                stride=_contiguous_stride(self.global_shape),
            )

    @property
    def sharded_local(self) -> torch.Tensor:
        """This rank's shard (a plain tensor, shared with the sharded parameter)."""
        local: torch.Tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        return local

    def _unsharded_local(self) -> torch.Tensor:
        up = self.unsharded_param
        assert up is not None
        if isinstance(up, DTensor):
            return up._local_tensor
        return up

    def _make_unsharded(self) -> nn.Parameter:
        local = torch.empty(self.unsharded_shape, dtype=self.param_dtype, device=self.device)
        if self.tp_mesh is None:
            return nn.Parameter(local, self.requires_grad)
        with torch.no_grad():
            dt = DTensor.from_local(
                local,
                self.tp_mesh,
                self.tp_placements,
                shape=self.global_shape,
                stride=_contiguous_stride(self.global_shape),
            )
        return nn.Parameter(dt, self.requires_grad)

    # -- all-gather input / output ---------------------------------------------------
    def padded_shard(self) -> torch.Tensor:
        """This rank's padded chunk, flat, in ``param_dtype`` on the device."""
        local = self.sharded_local.to(self.device, self.param_dtype)
        missing = self.chunk - self.local_length
        if missing:
            pad_shape = list(self.chunk_shape)
            pad_shape[self.dim] = missing
            pad = local.new_zeros(pad_shape)
            local = torch.cat([local, pad], dim=self.dim)
        return local.reshape(-1)

    def write_unsharded(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded parameter from its ``(shard size, chunk numel)`` gathered block."""
        size = self.info.shard_size
        blocks = gathered.reshape(size, *self.chunk_shape)
        length = self.unsharded_shape[self.dim]
        if self.dim == 0:
            full = blocks.reshape(size * self.chunk, *self.chunk_shape[1:]).narrow(0, 0, length)
        else:
            full = torch.cat(blocks.unbind(0), dim=self.dim).narrow(self.dim, 0, length)
        if self.unsharded_param is None:
            self.unsharded_param = self._make_unsharded()
        target = self._unsharded_local()
        _alloc_storage(target)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):  # type: ignore[attr-defined]
            target.copy_(full)

    def free_unsharded(self) -> None:
        if self.unsharded_param is not None:
            _free_storage(self._unsharded_local())

    # -- gradients ---------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient's local tensor (TP-laid-out as the parameter), cleared.

        A gradient Partial on a TP axis where the parameter is Replicate stays Partial
        (``tp_partial``): a sum over TP commutes with the reduce-scatter, so the group reduces
        the chunk after it (``1 / shard size`` of the bytes), and accumulating backwards add
        Partial locals. Should the Partial axes change between accumulated backwards, the
        pending sum is reduced first.
        """
        up = self.unsharded_param
        if up is None or up.grad is None:
            return None
        grad = up.grad
        up.grad = None
        if not isinstance(grad, DTensor):
            return grad
        want = leaf_grad_placements(self.tp_placements, grad.placements)
        partial = tuple(
            (axis, str(p.reduce_op))  # type: ignore[attr-defined]
            for axis, (p, mine) in enumerate(zip(want, self.tp_placements, strict=True))
            if p.is_partial() and not mine.is_partial()
        )
        if self.accumulated_grad is not None and partial != self.tp_partial:
            self.accumulated_grad = self.reduce_tp_partial(self.accumulated_grad)
            want, partial = self.tp_placements, ()
        if grad.placements != want:
            grad = grad.redistribute(grad.device_mesh, want)
        self.tp_partial = partial
        return grad._local_tensor  # type: ignore[attr-defined,no-any-return]

    def reduce_tp_partial(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a gradient or a chunk of one) reduced over the axes of ``tp_partial``."""
        for axis, op in self.tp_partial:
            assert self.tp_mesh is not None
            local = collectives.all_reduce(local, self.tp_mesh, axis, op)  # type: ignore[arg-type]
        self.tp_partial = ()
        return local

    def stacked_grad(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(shard size, chunk numel)``: row ``i`` is local rank ``i``'s padded gradient chunk."""
        size = self.info.shard_size
        grad = grad.to(dtype)
        missing = size * self.chunk - self.unsharded_shape[self.dim]
        if missing:
            pad_shape = list(self.unsharded_shape)
            pad_shape[self.dim] = missing
            grad = torch.cat([grad, grad.new_zeros(pad_shape)], dim=self.dim)
        if self.dim == 0:
            return grad.reshape(size, -1)
        return torch.stack(grad.chunk(size, dim=self.dim)).reshape(size, -1)

    def accept_sharded_grad(self, flat: torch.Tensor) -> None:
        """Add this rank's reduced chunk (flat, padded) to the sharded parameter's gradient."""
        chunk = flat.view(self.chunk_shape).narrow(self.dim, 0, self.local_length)
        target = torch.device("cpu") if self.offload else self.device
        chunk = chunk.to(target, self.orig_dtype).contiguous()
        sp = self.sharded_param
        if sp.grad is None:
            sp.grad = self._wrap_sharded(chunk)
        else:
            with torch.no_grad():
                sp.grad._local_tensor.add_(chunk)  # type: ignore[attr-defined]

    # -- registration ------------------------------------------------------------------
    def register(self, param: nn.Parameter) -> None:
        for slot in self.slots:
            slot.module._parameters[slot.name] = param


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and their collectives.

    Example::

        group.unshard()   # one all-gather
        group.reshard()
    """

    def __init__(
        self,
        params: list[FSDPParam],
        info: MeshInfo,
        mp: MixedPrecisionPolicy,
        device: torch.device,
    ) -> None:
        self.params = params
        self.info = info
        self.mp = mp
        self.device = device
        self.is_unsharded = False
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.divide_factor: float | None = None
        self.force_sum_reduction = False
        self.partial_reduce_output: torch.Tensor | None = None
        # per backward: how many unsharded params have their gradient; done once reduced
        self.grads_ready = 0
        self.post_backward_done = False
        self.in_backward = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def grad_params(self) -> list[FSDPParam]:
        return [p for p in self.params if p.requires_grad]

    def unshard(self) -> None:
        if self.is_unsharded:
            return
        if self.params:
            flat = torch.cat([p.padded_shard() for p in self.params])
            gathered = collectives.all_gather(flat, self.info.mesh, self.info.shard_axis)
            offset = 0
            for p in self.params:
                p.write_unsharded(gathered[:, offset : offset + p.chunk_numel])
                offset += p.chunk_numel
                if p.requires_grad and not self._hooks_registered(p):
                    self._register_grad_hook(p)
        for p in self.params:
            assert p.unsharded_param is not None
            p.register(p.unsharded_param)
        self.is_unsharded = True

    def _hooks_registered(self, p: FSDPParam) -> bool:
        return getattr(p, "_hooked", False)

    def _register_grad_hook(self, p: FSDPParam) -> None:
        assert p.unsharded_param is not None

        def ready(_: torch.Tensor) -> None:
            self.grads_ready += 1
            if self.grads_ready == len(self.grad_params):
                self.post_backward()

        self._hooks.append(p.unsharded_param.register_post_accumulate_grad_hook(ready))  # type: ignore[no-untyped-call]
        p._hooked = True  # type: ignore[attr-defined]

    def refresh_sharded(self) -> None:
        """Take the sharded parameters from the modules again (after ``to_empty`` / ``to``)."""
        for p in self.params:
            current = p.slots[0].module._parameters[p.slots[0].name]
            assert isinstance(current, nn.Parameter)
            if (
                current is p.sharded_param
                and p.unsharded_param is not None
                and p.unsharded_param.device == p.sharded_local.device
            ):
                continue
            p.sharded_param = current
            p.unsharded_param = None  # rebuilt on the new device at the next unshard
            p._hooked = False  # type: ignore[attr-defined]
            local = p.sharded_local
            if local.device.type != "meta" and not p.offload:
                p.device = local.device

    def reshard(self) -> None:
        if not self.is_unsharded:
            return
        for p in self.params:
            p.register(p.sharded_param)
            p.free_unsharded()
        self.is_unsharded = False

    def post_backward(self) -> None:
        """Reduce this backward's gradients into the sharded parameters' ``.grad`` (once)."""
        if self.post_backward_done:
            return
        self.post_backward_done = True
        reduce_dtype = self.mp.reduce_dtype or self.mp.param_dtype
        ready: list[tuple[FSDPParam, torch.Tensor]] = []
        for p in self.grad_params:
            grad = p.take_unsharded_grad()
            if grad is None and p.accumulated_grad is None:
                continue
            if p.accumulated_grad is not None:
                grad = p.accumulated_grad if grad is None else p.accumulated_grad + grad
                p.accumulated_grad = None
            assert grad is not None
            if not self.reduce_grads:
                # accumulate without communication, in the dtype the reduction would use
                p.accumulated_grad = grad.to(reduce_dtype or p.orig_dtype)
                continue
            ready.append((p, grad))
        if ready:
            self._reduce(ready, reduce_dtype or ready[0][0].orig_dtype)
        if self.reshard_after_backward:
            self.reshard()

    def _reduce(self, ready: list[tuple[FSDPParam, torch.Tensor]], dtype: torch.dtype) -> None:
        info = self.info
        stacked = torch.cat([p.stacked_grad(g, dtype) for p, g in ready], dim=1)
        out = collectives.reduce_scatter(stacked, info.mesh, info.shard_axis, "sum")
        if info.replicate_axis is not None:
            if self.partial_reduce_output is not None:
                out = out + self.partial_reduce_output
                self.partial_reduce_output = None
            if not self.all_reduce_grads:
                # HSDP accumulation with reduce-scatter only: all-reduced at a later backward
                self.partial_reduce_output = out
                return
            if info.replicate_size > 1:
                out = collectives.all_reduce(out, info.mesh, info.replicate_axis, "sum")
        factor = (
            self.divide_factor
            if self.divide_factor is not None
            else float(info.shard_size * info.replicate_size)
        )
        if factor != 1.0:
            out = out / factor
        self._reduce_tp_partial(ready, out)
        offset = 0
        for p, _ in ready:
            p.accept_sharded_grad(out[offset : offset + p.chunk_numel])
            offset += p.chunk_numel

    @staticmethod
    def _reduce_tp_partial(ready: list[tuple[FSDPParam, torch.Tensor]], out: torch.Tensor) -> None:
        """Reduce, in ``out``, the chunks of the gradients still Partial on TP axes.

        The chunks of one TP mesh and one set of Partial axes are reduced together, by one
        flat all-reduce per axis.
        """
        batches: dict[tuple[DeviceMesh, tuple[tuple[int, str], ...]], list[tuple[int, int]]] = {}
        offset = 0
        for p, _ in ready:
            if p.tp_partial and p.tp_mesh is not None:
                batches.setdefault((p.tp_mesh, p.tp_partial), []).append((offset, p.chunk_numel))
                p.tp_partial = ()
            offset += p.chunk_numel
        for (mesh, axes), spans in batches.items():
            chunks = [out[start : start + n] for start, n in spans]
            for chunk, reduced in zip(chunks, all_reduce_together(chunks, mesh, axes), strict=True):
                chunk.copy_(reduced)

    def reset_backward(self) -> None:
        self.grads_ready = 0
        self.post_backward_done = False
        self.in_backward = False


def spmd_layout(
    param: nn.Parameter,
    info: MeshInfo,
    shard_dim: int,
    find_joint: object,
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of ``param``'s sharded DTensor (see ``fully_shard``)."""
    dp_axes = ([info.replicate_axis] if info.replicate_axis is not None else []) + [info.shard_axis]
    dp_placements: list[Placement] = [Replicate() for _ in dp_axes[:-1]] + [Shard(shard_dim)]
    if not isinstance(param, DTensor):
        return info.mesh, tuple(dp_placements)
    tp_mesh = param.device_mesh
    tp_names = [*tp_mesh.mesh_dim_names]  # type: ignore[misc]
    tp_placements = tuple(param.placements)
    assert callable(find_joint)
    # torch's split_factor: the pieces the parameter's own (TP/EP) axes cut FSDP's dim into
    cutting = [i for i, p in enumerate(tp_placements) if p == Shard(shard_dim)]
    split = math.prod(tp_mesh.size(i) for i in cutting)
    if split > 1:
        if _strided_is_nested(param.shape[shard_dim], info.shard_size, split):
            # torch's layout: dp's chunk of each TP shard, described from the dp axis
            dp_placements[-1] = _StridedShard(shard_dim, sf=split)
            names = [info.axis_name(a) for a in dp_axes] + tp_names
            return find_joint(tuple(names)), (*dp_placements, *tp_placements)  # type: ignore[operator,no-any-return]
        # sizes where torch's _StridedShard would name other rows than FSDP holds: nested
        # in mesh order, tp's axes before dp's shard axis (the same shards, stated exactly)
        names = [
            *(info.axis_name(a) for a in dp_axes[:-1]),
            *tp_names,
            info.axis_name(info.shard_axis),
        ]
        placements = [*dp_placements[:-1], *tp_placements, Shard(shard_dim)]
    else:
        names = [info.axis_name(a) for a in dp_axes] + tp_names
        placements = [*dp_placements, *tp_placements]
    joint: DeviceMesh = find_joint(tuple(names))
    return joint, tuple(placements)


def _strided_is_nested(length: int, dp_size: int, tp_size: int) -> bool:
    """True when ``(_StridedShard(d, sf=tp), Shard(d))`` on (dp, tp) is FSDP's layout of a dim.

    FSDP holds on rank ``(i, j)`` the ``i``-th ``torch.chunk`` of the ``j``-th TP shard.
    The strided placement gives dp rank ``i`` its chunk ``i`` of every TP shard, and TP
    then chunks that concatenation again: the two agree when those chunks fall exactly on
    the TP shards' boundaries (always for even sizes).
    """
    for i in range(dp_size):
        held = [
            chunk_range(chunk_range(length, tp_size, j)[1], dp_size, i)[1] for j in range(tp_size)
        ]
        start = 0
        for j, size in enumerate(held):
            got_start, got_size = chunk_range(sum(held), tp_size, j)
            if got_size != size or (size and got_start != start):
                return False
            start += size
    return True
