"""qwen3-ref's parallelism plan, in one place and in the order it is applied.

Tensor parallelism over the mesh axis ``tp``, part by part in the order a step meets
them (SP: ``sequence_parallel``):

- ``tok_embeddings``: weight ``Shard(0)`` (vocabulary); tokens ``Replicate`` in, rows
  all-reduced to ``Replicate`` out (SP: reduce-scattered to ``Shard(1)``).
- ``attention_norm``, ``ffn_norm``, the final ``norm``: weight ``Replicate``; activations
  stay as they arrive.
- ``attention``: heads split, ``wq/wk/wv`` ``Shard(0)`` and ``wo`` ``Shard(1)``;
  ``q_norm``/``k_norm`` ``Replicate`` (they act per head, on the local heads; their
  gradients are partial sums over ``tp``, reduced); the RoPE tables ``Replicate``.
- ``feed_forward`` (dense layers): hidden units split, ``w1/w3`` ``Shard(0)``, ``w2``
  ``Shard(1)``; boundaries as attention's.
- ``output``: weight ``Shard(0)`` (vocabulary); logits ``Shard(-1)`` into the
  loss-parallel ``cross_entropy``.

``use_local_map``: the norms (with ``sequence_parallel`` they stay DTensor ops, as
llama-ref's), attention (the q/k norms' local gradients declared ``Partial`` over ``tp``)
and the dense feed-forwards are ``local_map`` regions with the boundaries above; the MoE
feed-forwards keep their path. ``region_blocks``: each dense block one outer ``local_map``
region (:func:`region_block_config`); MoE blocks stay as ``use_local_map`` makes them.

:func:`parallelize_qwen3` composes the rest as plain calls, TorchTitan's order: tensor
parallelism (:func:`apply_tp`), activation checkpointing, compile (:func:`apply_compile`),
fully sharded data parallelism (:func:`apply_fsdp`).

Example::

    >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
    >>> block_config(Qwen3.Config(), 0).attention.sharding_config.out_dst_shardings
    {MeshAxisName.TP: Replicate()}
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch

from hyper_parallel.dmodule.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint_mode,
)
from hyper_parallel.dmodule.layers import (
    Embedding,
    FeedForward,
    Linear,
    MoE,
    RMSNorm,
    block_sharding,
    expert_sharding,
)
from hyper_parallel.dmodule.layers._common import TP
from hyper_parallel.dmodule.models._sharding import (
    apply_compile,
    check_heads_divide_tp,
    data_parallel_mesh,
    mp_policy,
    region_block_parts,
    residual_stream_region,
)
from hyper_parallel.dmodule.models.qwen3_block import Qwen3Attention, Qwen3Block
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement, axis_name
from hyper_parallel.dtensor import DeviceMesh, DTensor, Partial, collectives
from hyper_parallel.dtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:  # annotations only: qwen3.py imports this file to build its parts
    from hyper_parallel.dmodule.models.qwen3 import Qwen3

__all__ = [
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "attention_config",
    "block_config",
    "embedding_config",
    "feed_forward_config",
    "norm_config",
    "output_config",
    "parallelize_qwen3",
    "region_block_config",
    "region_block_sharding",
]

_ROPE_BUFFERS = ("rope_cos", "rope_sin")
#: The per-head q/k norms' weights, declared by attention when it is a local_map region.
_QK_NORMS = ("q_norm.weight", "k_norm.weight")


# -- tensor parallelism: each part's Config, top of the model to its bottom ------------------
def embedding_config(config: Qwen3.Config) -> Embedding.Config:
    """``tok_embeddings``: vocab parallel (or replicated with ``vocab_parallel=False``).

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> embedding_config(Qwen3.Config()).sharding_config.state_shardings
        {'weight': {MeshAxisName.TP: Shard(dim=0)}}
    """
    if not config.vocab_parallel:
        return Embedding.Config.replicated(config.vocab_size, config.dim)
    return Embedding.Config.vocab_parallel(
        config.vocab_size, config.dim, sequence_parallel=config.sequence_parallel
    )


def norm_config(config: Qwen3.Config) -> RMSNorm.Config:
    """Each block's two norms and the final one: weight replicated (SP: sequence shards kept).

    With ``use_local_map`` (and no sequence parallelism, as llama-ref's) the norm runs on
    the local replicated tensors.

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> norm_config(Qwen3.Config(norm_eps=1e-5)).eps
        1e-05
    """
    if config.sequence_parallel:
        return RMSNorm.Config.sequence_parallel(config.dim, eps=config.norm_eps)
    if config.use_local_map:
        return RMSNorm.Config.local_map(config.dim, eps=config.norm_eps)
    return RMSNorm.Config(dim=config.dim, eps=config.norm_eps)


def attention_config(config: Qwen3.Config) -> Qwen3Attention.Config:
    """Attention, heads split over ``tp``: x in replicated, the partial sums out reduced.

    With ``use_local_map`` it is a ``local_map`` region (``block_sharding(local_map=True)``):
    the q/k norms act on this rank's heads, their weights replicated and their local
    gradients declared ``Partial`` over ``tp`` (:func:`_local_qk_norms`).

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> attention_config(Qwen3.Config(head_dim=32)).q_width
        128
        >>> attention_config(Qwen3.Config(use_local_map=True)).sharding_config.local_map.state_grad_placements
        {'q_norm.weight': {MeshAxisName.TP: Partial(reduce_op='sum')}, 'k_norm.weight': {MeshAxisName.TP: Partial(reduce_op='sum')}}
    """
    sharding = block_sharding(
        local_map=config.use_local_map,
        sequence_parallel=config.sequence_parallel,
        replicated_states=_ROPE_BUFFERS + _QK_NORMS if config.use_local_map else _ROPE_BUFFERS,
    )
    if config.use_local_map:
        sharding = _local_qk_norms(sharding)
    return Qwen3Attention.Config(
        dim=config.dim,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_seq_len=config.max_seq_len,
        rope_theta=config.rope_theta,
        norm_eps=config.norm_eps,
        sharding_config=sharding,
    )


def _local_qk_norms(sharding: ShardingConfig) -> ShardingConfig:
    """Attention's ``local_map`` sharding with the q/k norms' local gradients declared ``Partial``.

    Each ``tp`` rank normalises its own heads with the whole (replicated) norm weight, so
    its local gradient sums those heads only: a partial sum over ``tp``, reduced once
    where it accumulates (as the DTensor path's ``Replicate`` weight on ``Shard`` heads).
    """
    assert sharding.local_map is not None  # block_sharding(local_map=True) declares one
    partial: dict[str, NamedPlacement] = {name: {TP: Partial()} for name in _QK_NORMS}
    local_map = dataclasses.replace(sharding.local_map, state_grad_placements=partial)
    return dataclasses.replace(sharding, local_map=local_map)


def feed_forward_config(config: Qwen3.Config) -> FeedForward.Config:
    """The dense layers' SwiGLU MLP, hidden units split over ``tp``.

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> feed_forward_config(Qwen3.Config(ffn_dim=96)).hidden_dim
        96
    """
    return FeedForward.Config.tensor_parallel(
        local_map=config.use_local_map,
        sequence_parallel=config.sequence_parallel,
        dim=config.dim,
        hidden_dim=config.ffn_dim,
    )


def moe_config(config: Qwen3.Config) -> MoE.Config:
    """The MoE blocks' mixture of experts: routed experts ``Shard(0)`` on ``ep`` (``etp``:
    hidden units split), the router replicated; transformers' routing (softmax, top-k,
    ``route_norm``), load balancing only as the config asks.

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> moe_config(Qwen3.Config(num_experts=8, top_k=2)).top_k
        2
    """
    return MoE.Config(
        dim=config.dim,
        hidden_dim=config.moe_ffn_dim,
        num_experts=config.num_experts,
        top_k=config.top_k,
        score_func="softmax",
        route_norm=config.route_norm,
        load_balance_coeff=config.load_balance_coeff,
        aux_loss_coeff=config.aux_loss_coeff,
    )


def block_config(config: Qwen3.Config, layer: int) -> Qwen3Block.Config:
    """Block ``layer``: norm, attention, norm, then the dense MLP or the MoE.

    With ``region_blocks`` a dense block is itself a ``local_map`` region
    (:func:`region_block_config`); a MoE block stays as ``use_local_map`` makes it.

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> block_config(Qwen3.Config(dim=32, n_heads=4), 0).attention.dim
        32
    """
    moe = config.is_moe_layer(layer)
    if config.region_blocks and not moe:
        return region_block_config(config)
    norm = norm_config(config)
    return Qwen3Block.Config(
        attention_norm=norm,
        attention=attention_config(config),
        ffn_norm=norm.replace(),
        feed_forward=moe_config(config) if moe else feed_forward_config(config),
    )


# -- region_blocks: each dense block one outer local_map region --------------------------------
def region_block_sharding(config: Qwen3.Config) -> ShardingConfig:
    """The dense block as an OUTER ``local_map`` region: the residual stream in and out.

    :func:`~hyper_parallel.dmodule.models._sharding.residual_stream_region` for this
    config's ``sequence_parallel`` (the layout and why, written once there).

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> cfg = Qwen3.Config(use_local_map=True, region_blocks=True, sequence_parallel=True)
        >>> region_block_sharding(cfg).out_src_shardings
        {MeshAxisName.TP: Shard(dim=1)}
    """
    return residual_stream_region(config.sequence_parallel)


def region_block_config(config: Qwen3.Config) -> Qwen3Block.Config:
    """The dense block of ``region_blocks``: its parts as inner regions of the block's region.

    The norms are ``local_map`` regions in either layout (with ``sequence_parallel`` their
    replicated weight's local gradient is declared ``Partial``); attention's (q/k norms'
    gradients declared ``Partial``, :func:`attention_config`) and feed-forward's input is
    declared a sequence shard (``in_src``) with ``sequence_parallel``, as the norm leaves
    it: an inner region receives plain tensors, whose layout is only what it declares.
    MoE blocks are never regions (:func:`block_config`).

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> cfg = Qwen3.Config(use_local_map=True, region_blocks=True, sequence_parallel=True)
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
    return Qwen3Block.Config(**parts)


def output_config(config: Qwen3.Config) -> Linear.Config:
    """The output projection: column parallel over the vocab, logits left ``Shard(-1)``.

    Example::

        >>> from hyper_parallel.dmodule.models.qwen3 import Qwen3
        >>> output_config(Qwen3.Config()).sharding_config.out_dst_shardings
        {MeshAxisName.TP: Shard(dim=-1)}
    """
    if not config.vocab_parallel:
        return Linear.Config.replicated(config.dim, config.vocab_size)
    return Linear.Config.colwise(
        config.dim, config.vocab_size, sequence_parallel=config.sequence_parallel
    )


# -- the composition: TP -> EP -> activation checkpointing -> compile -> FSDP --------------
def parallelize_qwen3(
    model: Qwen3, mesh: DeviceMesh | ParallelDims, job_config: object = None
) -> Qwen3:
    """The spec's ``parallelize_fn``: TP and EP, activation checkpointing, compile, then FSDP.

    The Configs' layouts (:func:`apply_tp`: dense states over ``tp``, routed experts over
    ``ep``/``etp`` of the expert view); then activation checkpointing of every block when
    ``job_config.activation_checkpoint`` (or its ``.mode``) is ``"full"`` or
    ``"selective"``; then the ``local_map`` blocks compiled when ``compile_local_map`` is
    set; then fully sharded data parallelism (:func:`apply_fsdp`), every unit with
    ``job_config["mp_policy"]`` (a ``MixedPrecisionPolicy``, default none).

    Example::

        model = parallelize_qwen3(Qwen3.Config().build(), ParallelDims(dp_shard=2, ep=2))
        model = parallelize_qwen3(Qwen3.Config().build(), mesh, {"activation_checkpoint": "full"})
    """
    ac_mode = checkpoint_mode(job_config)  # checked before anything changes
    policy = mp_policy(job_config, where="parallelize_qwen3")
    _check_expert_layout(model, mesh)
    _check_expert_precision(model, mesh, policy)
    tp_mesh = _tp_mesh(mesh)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh)
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
    return None if axis_name(MeshAxisName.DP_SHARD) in names else mesh


def apply_tp(model: Qwen3, mesh: DeviceMesh | ParallelDims) -> Qwen3:
    """Check the head counts divide by ``tp`` (experts by ``ep``), then shard as declared above.

    One :meth:`Module.parallelize` places every state: dense ones on the dense view, the
    routed experts on the expert view (``Shard(0)`` on ``ep``) when given a
    :class:`ParallelDims`. With ``etp == tp > 1`` the experts' hidden units are split over
    ``etp`` too (:func:`~hyper_parallel.dmodule.layers.expert_sharding` with ``etp=True``)
    and each MoE takes its tokens replicated over ``tp`` (gathered from sequence shards
    under ``sequence_parallel``, its output sliced back to them). Nothing changes when a
    check fails.

    Example::

        apply_tp(Qwen3.Config().build(), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        apply_tp(Qwen3.Config(num_experts=4).build(), ParallelDims(dp_shard=2, tp=2, ep=2, etp=2))
    """
    check_heads_divide_tp(model.config, mesh, where="Qwen3.parallelize")
    etp = isinstance(mesh, ParallelDims) and mesh.etp_enabled
    restore = _use_expert_tensor_parallel(model) if etp else []
    try:
        Module.parallelize(model, mesh)
    except BaseException:
        for module, sharding in restore:  # a refused layout leaves the model as it was
            module.set_sharding_config(sharding)
        raise
    return model


def _use_expert_tensor_parallel(model: Qwen3) -> list[tuple[Module, ShardingConfig | None]]:
    """Give every MoE the ``etp`` layouts; the modules and the layouts they had, to undo it.

    Under ``etp`` each rank of a ``tp`` group computes a slice of the same tokens' expert
    outputs, summed over ``etp``: the MoE's input must be the same on those ranks, so it
    enters replicated over ``tp`` (``block_sharding``'s boundaries, as attention's).
    """
    sequence_parallel = model.config.sequence_parallel
    changed: list[tuple[Module, ShardingConfig | None]] = []
    for layer in model.layers:
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue
        for module, sharding in (
            (moe, block_sharding(sequence_parallel=sequence_parallel)),
            (moe.experts, expert_sharding(etp=True)),
        ):
            changed.append((module, module.set_sharding_config(sharding)))
    return changed


def apply_fsdp(
    model: Qwen3,
    mesh: DeviceMesh | ParallelDims,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Qwen3:
    """``fully_shard`` over the data-parallel axes (``dp_shard``, and ``dp_replicate``: HSDP).

    The units are TorchTitan's: the embeddings, each block, the final norm and the output
    together (with tied embeddings: the embedding, the norm and the output, one unit
    holding their one shared weight), then the root; under a :class:`ParallelDims` the routed experts first, over
    ``efsdp``. Every unit takes ``mp_policy`` (TorchTitan's mixed precision). A mesh
    without a ``dp_shard`` axis leaves the model as it is.

    Example::

        model = parallelize_qwen3(Qwen3.Config().build(), ParallelDims(dp_shard=2, tp=2))
    """
    resolved = data_parallel_mesh(mesh, where="apply_fsdp")
    if resolved is None:
        return model
    dp_mesh = resolved.mesh
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    expert_params = _expert_parameters(model, mesh, policy)
    expert_ids = {id(p) for p in expert_params}
    # tied embeddings: one Parameter in two modules goes in one unit, with the output's
    tied = model.config.tie_word_embeddings
    if not tied:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=policy)
    for layer in model.layers:
        # the routed experts stay on the expert view (their FSDP, over efsdp, is ep's business)
        mine = {p for p in layer.parameters() if id(p) in expert_ids}
        fully_shard(layer, mesh=dp_mesh, ignored_params=mine or None, mp_policy=policy)
    ends = [model.tok_embeddings, model.norm, model.output] if tied else [model.norm, model.output]
    fully_shard(ends, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, ignored_params=expert_params or None, mp_policy=policy)
    return model


def _check_expert_layout(model: Qwen3, mesh: DeviceMesh | ParallelDims) -> None:
    """Refuse what this plan cannot lay out, before anything changes: ``cp > 1`` (Qwen3's
    attention has no context-parallel form), from a ParallelDims or a mesh's ``cp`` axis."""
    if isinstance(mesh, ParallelDims):
        cp, what = mesh.cp, f"cp={mesh.cp}"
    else:
        names = tuple(mesh.mesh_dim_names or ())
        cp = mesh.size("cp") if "cp" in names else 1
        what = f"mesh axis 'cp' of size {cp} in {mesh}"
    if cp > 1:
        raise ValueError(
            f"parallelize_qwen3: {what}: Qwen3Attention has no context parallelism (each "
            "rank would run the whole sequence); expected cp=1"
        )


def _check_expert_precision(
    model: Qwen3, mesh: DeviceMesh | ParallelDims, policy: MixedPrecisionPolicy
) -> None:
    """Refuse a lower ``param_dtype`` when the routed experts sit outside every FSDP unit.

    Only EP with copies (``efsdp x dp_replicate > 1``) gives the experts FSDP units of their
    own; otherwise they keep float32 weights that bfloat16 tokens cannot multiply.
    """
    if not isinstance(mesh, ParallelDims) or not mesh.fsdp_enabled:
        return
    if policy.param_dtype in (None, torch.float32):
        return
    if not any(hasattr(layer.feed_forward, "experts") for layer in model.layers):
        return
    if mesh.ep_enabled and mesh.efsdp * mesh.dp_replicate > 1:
        return
    raise ValueError(
        f"parallelize_qwen3: job_config['mp_policy'].param_dtype = {policy.param_dtype}: "
        f"the routed experts get FSDP units (and so the policy) only under ep > 1 with "
        f"efsdp x dp_replicate > 1, found ep = {mesh.ep}, efsdp = {mesh.efsdp}, "
        f"dp_replicate = {mesh.dp_replicate}; expected float32 or that layout"
    )


def _expert_parameters(
    model: Qwen3, mesh: DeviceMesh | ParallelDims, policy: MixedPrecisionPolicy
) -> set[torch.nn.Parameter]:
    """Make each routed expert's gradient the global mean; the parameters dense FSDP must skip.

    An expert's gradient on a rank is the sum of the mean losses' gradients of the ranks
    whose tokens reached it: every rank of ``ep`` (the all-to-all's backward brings them
    back). Summed over the expert's copies (``efsdp`` and ``dp_replicate``) and divided by
    the ranks it then counts, it is the gradient of the global batch's mean loss, as
    FSDP's average makes the dense ones. Under EP with copies, the experts' own FSDP units
    over ``efsdp`` do it (TorchTitan's), with ``policy``; otherwise (``ep == 1``: replicated
    experts, or no copies) a gradient hook does, and the dense units skip the returned
    parameters.
    """
    if not isinstance(mesh, ParallelDims):
        return set()
    found = (getattr(layer.feed_forward, "experts", None) for layer in model.layers)
    experts: list[torch.nn.Module] = [e for e in found if isinstance(e, torch.nn.Module)]
    if not experts:
        return set()
    _check_expert_layout(model, mesh)
    # the ranks that counted each token: ep*efsdp*dp_replicate covers tp's ranks, which
    # all route the same tokens unless ep borrows them (etp = 1), when each routes 1/tp
    borrowed = mesh.tp if mesh.ep_enabled and not mesh.etp_enabled else 1
    factor = float(mesh.ep * mesh.efsdp * mesh.dp_replicate // borrowed)
    if mesh.ep_enabled and mesh.efsdp * mesh.dp_replicate > 1:
        # TorchTitan's layout: the experts' copies sharded over efsdp by their own FSDP units,
        # whose sum over the copies, divided by every rank the sum counts, is the mean
        for module in experts:
            unit = fully_shard(module, mesh=mesh.efsdp_mesh, mp_policy=policy)
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(factor)
        return set()
    copies = [
        axis
        for axis, size in (("dp_replicate", mesh.dp_replicate), ("efsdp", mesh.efsdp))
        if size > 1
    ]
    mean = _GradMean(
        mesh.get_mesh(tuple(copies)) if copies else None,
        tuple(copies),
        factor,
    )
    params: set[torch.nn.Parameter] = set()
    for module in experts:
        # on the module, not on the parameters: to_empty and load replace those
        module.register_forward_pre_hook(mean)
        params.update(module.parameters())
    return params


class _GradMean:
    """Forward pre-hook: each gradient the module's parameters receive is summed over the
    expert's copies and divided, before it is accumulated.

    Per contribution (a tensor hook, not a post-accumulate one): with gradient
    accumulation or a pipeline's microbatches a parameter receives several, and each
    is reduced exactly once, so their sum is the reduced sum.
    """

    def __init__(self, mesh: DeviceMesh | None, axes: tuple[str, ...], factor: float) -> None:
        self.mesh, self.axes, self.factor = mesh, axes, factor
        # by identity (tensors compare by value); a weak reference tells a reused id apart
        self.hooked: dict[int, weakref.ref[torch.Tensor]] = {}

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        for param in module.parameters(recurse=False):
            seen = self.hooked.get(id(param))
            if seen is None or seen() is not param:
                param.register_hook(self._reduce)  # type: ignore[no-untyped-call]
                self.hooked[id(param)] = weakref.ref(param)

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if self.mesh is not None:
            local = collectives.all_reduce_over(local, self.mesh, self.axes, "sum")
        local = local / self.factor
        if isinstance(grad, DTensor):
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
            )
        return local
