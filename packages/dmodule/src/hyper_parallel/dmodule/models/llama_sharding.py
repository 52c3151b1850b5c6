"""llama-ref's parallelism plan, in one place and in the order it is applied.

Tensor parallelism over the mesh axis ``tp``, part by part in the order a step meets
them (SP: ``sequence_parallel``; LM: ``use_local_map``):

- ``tok_embeddings``: weight ``Shard(0)`` (a slice of the vocabulary per rank); tokens
  ``Replicate`` in, the partial rows all-reduced to ``Replicate`` out (SP: reduce-scattered
  to sequence shards ``Shard(1)``).
- ``attention_norm``, ``ffn_norm`` and the final ``norm``: weight ``Replicate``; the
  activations stay as they arrive, ``Replicate`` (SP: ``Shard(1)``; the norm is per token,
  so no collective); LM: run on the local tensors.
- ``attention``: heads split, ``wq/wk/wv`` ``Shard(0)`` (column) and ``wo`` ``Shard(1)``
  (row), the RoPE tables ``Replicate``; x all-gathered to ``Replicate`` (from ``Shard(1)``
  with SP), ``wo``'s partial sums all-reduced to ``Replicate`` (SP: reduce-scattered to
  ``Shard(1)``). LM: the local heads on local tensors, the output declared ``Partial``
  and so is the gradient of x.
- ``feed_forward``: hidden units split, ``w1/w3`` ``Shard(0)`` and ``w2`` ``Shard(1)``;
  its boundaries are attention's.
- ``output``: weight ``Shard(0)`` (vocabulary); x ``Replicate`` (all-gathered with SP);
  the logits stay ``Shard(-1)`` into the loss-parallel ``cross_entropy``.
- ``region_blocks`` (with LM): each block one outer ``local_map`` region over the residual
  stream (``Replicate``; SP: ``Shard(1)``), its norms (``local_map`` in either layout),
  attention and feed-forward inner regions: the residual adds are plain torch.

With ``vocab_parallel=False`` the embedding and the output hold their whole weights
(``Replicate``) and the logits are replicated. The projections' own layouts are those
of :class:`~hyper_parallel.dmodule.layers.Attention` and ``FeedForward`` (column then
row parallel is what those layers are); everything else is chosen below.

:func:`parallelize_llama` then composes the rest as plain calls, TorchTitan's order:
tensor parallelism (:func:`apply_tp`), activation checkpointing, compile
(:func:`apply_compile`), fully sharded data parallelism (:func:`apply_fsdp`).

Example::

    >>> from hyper_parallel.dmodule.models.llama import Llama
    >>> block_config(Llama.Config(sequence_parallel=True)).ffn_norm.sharding_config.out_dst_shardings
    {MeshAxisName.TP: Shard(dim=1)}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch.utils.hooks import RemovableHandle

from hyper_parallel.dmodule.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint_mode,
)
from hyper_parallel.dmodule.context_parallel import CP_AXIS, ContextParallel
from hyper_parallel.dmodule.layers import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
    TransformerBlock,
)
from hyper_parallel.dmodule.models._sharding import (
    apply_compile,
    check_heads_divide_tp,
    data_parallel_mesh,
    mp_policy,
    region_block_parts,
    residual_stream_region,
)
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives
from hyper_parallel.dtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:  # annotations only: llama.py imports this file to build its parts
    from hyper_parallel.dmodule.models.llama import Llama

__all__ = [
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "apply_tp",
    "attention_config",
    "block_config",
    "check_cp",
    "embedding_config",
    "feed_forward_config",
    "norm_config",
    "output_config",
    "parallelize_llama",
    "region_block_config",
    "region_block_sharding",
    "split_cp_mesh",
]


# -- tensor parallelism: each part's Config, top of the model to its bottom ------------------
def embedding_config(config: Llama.Config) -> Embedding.Config:
    """``tok_embeddings``: vocab parallel (or replicated with ``vocab_parallel=False``).

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> embedding_config(Llama.Config()).sharding_config.state_shardings
        {'weight': {MeshAxisName.TP: Shard(dim=0)}}
    """
    if not config.vocab_parallel:
        return Embedding.Config.replicated(config.vocab_size, config.dim)
    return Embedding.Config.vocab_parallel(
        config.vocab_size, config.dim, sequence_parallel=config.sequence_parallel
    )


def norm_config(config: Llama.Config) -> RMSNorm.Config:
    """Every RMSNorm of the model (both of each block's and the final one): weight replicated.

    With sequence parallelism the activations stay sequence shards (the norm is per
    token: no collective); with ``use_local_map`` it runs on the local replicated tensors.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> norm_config(Llama.Config(use_local_map=True)).sharding_config.local_map is not None
        True
    """
    if config.sequence_parallel:
        return RMSNorm.Config.sequence_parallel(config.dim, eps=config.norm_eps)
    if config.use_local_map:
        return RMSNorm.Config.local_map(config.dim, eps=config.norm_eps)
    return RMSNorm.Config(dim=config.dim, eps=config.norm_eps)


def attention_config(config: Llama.Config) -> Attention.Config:
    """Attention, heads split over ``tp``: x in replicated, the partial sums out reduced.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> attention_config(Llama.Config(n_heads=8)).n_heads
        8
    """
    return Attention.Config.tensor_parallel(
        local_map=config.use_local_map,
        sequence_parallel=config.sequence_parallel,
        dim=config.dim,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        max_seq_len=config.max_seq_len,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        use_rope=config.use_rope,
        context_parallel=config.context_parallel,
    )


def feed_forward_config(config: Llama.Config) -> FeedForward.Config:
    """SwiGLU feed-forward, hidden units split over ``tp``: the boundaries of attention.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> feed_forward_config(Llama.Config(ffn_dim=96)).hidden_dim
        96
    """
    return FeedForward.Config.tensor_parallel(
        local_map=config.use_local_map,
        sequence_parallel=config.sequence_parallel,
        dim=config.dim,
        hidden_dim=config.ffn_dim,
    )


def block_config(config: Llama.Config) -> TransformerBlock.Config:
    """One block: norm, attention, norm, feed-forward (every block of the model is alike).

    With ``region_blocks`` the block is itself a ``local_map`` region
    (:func:`region_block_sharding`).

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> block_config(Llama.Config(dim=32, n_heads=4)).attention.dim
        32
    """
    if config.region_blocks:
        return region_block_config(config)
    norm = norm_config(config)
    return TransformerBlock.Config(
        attention_norm=norm,
        attention=attention_config(config),
        # a copy sharing the norm's placement objects, whose comparisons then succeed by
        # identity (measured: two fresh configs cost 2 Placement.__eq__ calls per block and step)
        ffn_norm=norm.replace(),
        feed_forward=feed_forward_config(config),
    )


# -- region_blocks: each block one outer local_map region --------------------------------------
def region_block_sharding(config: Llama.Config) -> ShardingConfig:
    """The block as an OUTER ``local_map`` region: the residual stream in and out.

    :func:`~hyper_parallel.dmodule.models._sharding.residual_stream_region` for this
    config's ``sequence_parallel`` (the layout and why, written once there).

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> cfg = Llama.Config(use_local_map=True, region_blocks=True, sequence_parallel=True)
        >>> region_block_sharding(cfg).out_src_shardings
        {MeshAxisName.TP: Shard(dim=1)}
    """
    return residual_stream_region(config.sequence_parallel)


def region_block_config(config: Llama.Config) -> TransformerBlock.Config:
    """The block of ``region_blocks``: its parts as inner regions of the block's region.

    The norms are ``local_map`` regions in either layout (with ``sequence_parallel``
    their replicated weight's local gradient is declared ``Partial``); attention's and
    feed-forward's input is declared a sequence shard (``in_src``), as the norm leaves
    it: an inner region receives plain tensors, whose layout is only what it declares.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> cfg = Llama.Config(use_local_map=True, region_blocks=True, sequence_parallel=True)
        >>> region_block_config(cfg).attention.sharding_config.in_src_shardings
        {'x': {MeshAxisName.TP: Shard(dim=1)}}
    """
    parts = region_block_parts(
        config.dim,
        config.norm_eps,
        config.sequence_parallel,
        attention_config(config),
        feed_forward_config(config),
    )
    return TransformerBlock.Config(**parts)


def output_config(config: Llama.Config) -> Linear.Config:
    """The output projection: column parallel over the vocab, logits left ``Shard(-1)``.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> output_config(Llama.Config()).sharding_config.out_dst_shardings
        {MeshAxisName.TP: Shard(dim=-1)}
    """
    if not config.vocab_parallel:
        return Linear.Config.replicated(config.dim, config.vocab_size)
    return Linear.Config.colwise(
        config.dim, config.vocab_size, sequence_parallel=config.sequence_parallel
    )


# -- the composition: TP -> activation checkpointing -> compile -> FSDP -----------------------
def parallelize_llama(
    model: Llama, mesh: DeviceMesh | ParallelDims, job_config: object = None
) -> Llama:
    """The spec's ``parallelize_fn``: TP, activation checkpointing, compile, then FSDP.

    The Configs' layouts over ``mesh["tp"]``; then activation checkpointing of every block
    when ``job_config.activation_checkpoint`` (or its ``.mode``) is ``"full"`` or
    ``"selective"``; then the ``local_map`` blocks compiled when the model's
    ``compile_local_map`` says so; then, on a mesh with a ``dp_shard`` axis (and
    ``dp_replicate``), fully sharded data parallelism over it (:func:`apply_fsdp`), every
    unit with ``job_config["mp_policy"]`` (a ``MixedPrecisionPolicy``, default none). A
    :class:`ParallelDims` gives TP over its ``tp`` view and FSDP over its ``fsdp`` view.

    Example::

        model = parallelize_llama(Llama.Config().build(), ParallelDims(dp_shard=2, tp=2))
        model = parallelize_llama(Llama.Config().build(), mesh)
        model = parallelize_llama(Llama.Config().build(), mesh, {"activation_checkpoint": "full"})
    """
    ac_mode = checkpoint_mode(job_config)  # checked before anything changes
    policy = mp_policy(job_config, where="parallelize_llama")
    cp_mesh, tp_from_cp = split_cp_mesh(mesh)
    tp_mesh = _tp_mesh(mesh) if cp_mesh is None else tp_from_cp
    check_cp(model, cp_mesh, tp_mesh)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
    # FSDP's hooks stay outside the checkpointed forward, so the recompute does not unshard twice
    apply_activation_checkpointing(model.layers, mode=ac_mode)
    apply_compile(model)
    apply_fsdp(model, mesh, mp_policy=policy)
    return model


def _tp_mesh(mesh: DeviceMesh | ParallelDims) -> DeviceMesh | ParallelDims | None:
    """The mesh tensor parallelism runs over (``None``: a data-parallel-only mesh)."""
    if isinstance(mesh, ParallelDims):
        return mesh  # each state resolves its own view
    names = tuple(mesh.mesh_dim_names or ())
    tp_name = axis_name(MeshAxisName.TP)
    if tp_name in names:
        return mesh[tp_name] if len(names) > 1 else mesh
    return None if axis_name(MeshAxisName.DP_SHARD) in names or CP_AXIS in names else mesh


def split_cp_mesh(
    mesh: DeviceMesh | ParallelDims,
) -> tuple[DeviceMesh | None, DeviceMesh | ParallelDims | None]:
    """``(cp mesh or None, what tensor parallelism runs over or None)``.

    A mesh without a ``cp`` axis is all tensor parallel, as before; with one, tensor
    parallelism runs over its ``tp`` axis alone (if any). A ``cp`` axis of size 1 is no
    context parallelism. A :class:`ParallelDims` gives its ``cp`` view, and itself for
    TP when ``cp`` is 1 (else its ``tp`` view, or ``None`` when ``tp`` is 1).

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        cp_mesh, tp_mesh = split_cp_mesh(mesh)   # mesh["cp"], mesh["tp"]
    """
    if isinstance(mesh, ParallelDims):
        if mesh.cp == 1:
            return None, mesh
        return mesh.get_mesh(CP_AXIS), (mesh.get_mesh("tp") if mesh.tp > 1 else None)
    names = tuple(mesh.mesh_dim_names or ())
    if CP_AXIS not in names:
        return None, mesh
    tp_name = axis_name(MeshAxisName.TP)
    tp_mesh = mesh[tp_name] if tp_name in names else None
    cp_mesh = mesh[CP_AXIS] if len(names) > 1 else mesh
    return (cp_mesh if cp_mesh.size() > 1 else None), tp_mesh


def check_cp(
    model: Llama, cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | ParallelDims | None
) -> None:
    """Raise a ``ValueError`` unless context parallelism over ``cp_mesh`` can apply to ``model``.

    Every block's attention must support it (``supports_context_parallel``); with
    ``"alltoall"`` the key/value heads per ``tp`` rank must divide by the ``cp`` size.

    Example::

        check_cp(model, mesh["cp"], None)   # before anything changes
    """
    if cp_mesh is None:
        return
    cp = cp_mesh.size()
    for i, layer in enumerate(model.layers):
        attention = getattr(layer, "attention", None)
        if not getattr(attention, "supports_context_parallel", False):
            raise ValueError(
                f"Llama.parallelize: mesh axis 'cp' has size {cp}, but layers.{i}.attention "
                f"({type(attention).__name__}) does not support context parallelism (expected "
                "an attention with supports_context_parallel = True)"
            )
    cfg = model.config
    tp = (
        tp_mesh.size()
        if isinstance(tp_mesh, DeviceMesh) and tp_mesh.mesh_dim_names == ("tp",)
        else 1
    )
    n_kv = cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads
    if cfg.context_parallel == "alltoall" and (n_kv // tp) % cp:
        raise ValueError(
            f"Llama.parallelize: context_parallel='alltoall' needs the key/value heads per tp "
            f"rank (n_kv_heads {n_kv} / tp {tp} = {n_kv // tp}) to divide by the size of mesh "
            f"axis 'cp' ({cp})"
        )


def apply_cp(model: Llama, cp_mesh: DeviceMesh) -> Llama:
    """Split the sequence over ``cp_mesh`` (head-tail order) and complete gradients over it.

    Every attention gets the ``cp`` axis and ``model.config.context_parallel``'s algorithm;
    each parameter's gradient is summed over ``cp`` as autograd produces it (a tensor
    hook, so accumulation over micro-batches stays right), so that when ``backward``
    returns the gradients are the one-process ones. Parameters that replace the model's
    later (``to_empty`` after a build on the meta device, as a pipeline stage's
    ``init_weights`` does) get the hook at the next forward. FSDP over ``cp`` takes this
    over (:func:`apply_fsdp`).

    Example::

        apply_cp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
    """
    cp = ContextParallel(cp_mesh, model.config.context_parallel)
    model.context_parallel = cp
    for layer in model.layers:
        layer.attention.context_parallel = cp  # type: ignore[union-attr]
    model.__dict__["_cp_grad_hooks"] = _SumGradsOverCp(model, cp_mesh)
    return model


class _SumGradsOverCp:
    """The gradient hooks of :func:`apply_cp`, kept on the model's current parameters."""

    def __init__(self, model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
        self._mesh = cp_mesh
        self._hooked: dict[int, tuple[torch.nn.Parameter, RemovableHandle]] = {}
        self.attach(model)
        self._pre_hook = model.register_forward_pre_hook(lambda module, _: self.attach(module))

    def attach(self, model: torch.nn.Module) -> None:
        """Hook the parameters not hooked yet; drop the hooks of parameters replaced since."""
        current = {id(p): p for p in model.parameters()}
        for key, (param, handle) in list(self._hooked.items()):
            if current.get(key) is not param:
                handle.remove()
                del self._hooked[key]
        for key, param in current.items():
            if key not in self._hooked:
                handle = param.register_hook(self._sum)  # type: ignore[no-untyped-call]
                self._hooked[key] = (param, handle)

    def remove(self) -> None:
        """Remove every hook (FSDP's reduction over ``cp`` replaces them)."""
        self._pre_hook.remove()
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor):
            local = collectives.all_reduce(grad.to_local(), self._mesh, CP_AXIS, "sum")
            return DTensor.from_local(local, grad.device_mesh, grad.placements)
        return collectives.all_reduce(grad, self._mesh, CP_AXIS, "sum")


def apply_tp(model: Llama, mesh: DeviceMesh | ParallelDims) -> Llama:
    """Check the head counts divide by the ``tp`` size, then shard as the Configs above declare.

    Example::

        apply_tp(Llama.Config().build(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    """
    check_heads_divide_tp(model.config, mesh, where="Llama.parallelize")
    Module.parallelize(model, mesh)
    return model


def apply_fsdp(
    model: Llama,
    mesh: DeviceMesh | ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Llama:
    """``fully_shard`` over the mesh's ``dp_shard`` (and ``dp_replicate``: HSDP) axes, after TP.

    The units are TorchTitan's: the embeddings, each block, the final norm and the output
    together (with tied embeddings: the embedding, the norm and the output, one unit
    holding their one shared weight), then the root, each with ``mp_policy`` (TorchTitan's mixed precision: e.g.
    bfloat16 compute copies of float32 weights). A mesh without a ``dp_shard`` axis leaves
    the model as it is.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = parallelize_llama(Llama.Config().build(), mesh)   # TP, then FSDP
    """
    cp = model.context_parallel.size if model.context_parallel is not None else 1
    resolved = data_parallel_mesh(mesh, cp=cp, where="apply_fsdp")
    if resolved is None:
        return model
    dp_mesh, data_parallel = resolved  # with cp: FSDP sums the cp ranks' gradients too
    if cp > 1:
        # FSDP's reduction over cp replaces the gradient hooks of apply_cp
        hooks = model.__dict__.pop("_cp_grad_hooks", None)
        if hooks is not None:
            hooks.remove()
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    # tied embeddings: one Parameter in two modules goes in one unit, with the output's
    tied = model.config.tie_word_embeddings
    if not tied:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=policy)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    ends = [model.tok_embeddings, model.norm, model.output] if tied else [model.norm, model.output]
    fully_shard(ends, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    if cp > 1:  # a sum over the cp ranks (each holds a share of one loss), a mean over the data
        cast("FSDPModule", model).set_gradient_divide_factor(float(data_parallel))
    return model
