"""Bench entry (e): a Llama written the way hp-dmodule's README teaches a user.

The user's own :class:`~hyper_parallel.dmodule.Module` subclasses for the norm, the
attention and the MLP, each declaring its layouts in its ``Config.sharding_config`` and
running its forward on local tensors (``local_map=LocalMapConfig(...)``): column-parallel
``wq/wk/wv/w1/w3``, row-parallel ``wo/w2`` whose partial sums are all-reduced at the
block's output, replicated embedding, norms and output projection (the plan of the
Megatron baseline (a)). Nothing of the project's own layers is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig
from bench.ours.llama_ref import full_grads, zero_grads

from hyper_parallel.dmodule import (
    LocalMapConfig,
    MeshAxisName,
    Module,
    ShardingConfig,
    compile_local_maps,
)
from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.dtensor import Partial, Replicate, Shard, init_device_mesh

__all__ = [
    "build_user_model_compiled_blocks_step",
    "build_user_model_nested_compiled_step",
    "build_user_model_region_compiled_step",
    "build_user_model_region_step",
    "build_user_model_nested_step",
    "build_user_model_compiled_step",
    "build_user_model_step",
]

TP = MeshAxisName.TP
REPLICATED = {TP: Replicate()}


def _weight(rows: int, cols: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(rows, cols))


class Norm(Module):
    """RMSNorm on replicated activations, run on local tensors."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 128
        eps: float = 1e-5
        sharding_config = ShardingConfig(
            state_shardings={"weight": REPLICATED},
            in_dst_shardings={"x": REPLICATED},
            out_src_shardings=REPLICATED,
            local_map=LocalMapConfig(),
        )

    def __init__(self, config: Norm.Config) -> None:
        super().__init__()
        self.eps = config.eps
        self.weight = torch.nn.Parameter(torch.ones(config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# A column-then-row parallel block: replicated input, Partial local output reduced to
# Replicate at the boundary; the input's gradient is a partial sum over tp.
BLOCK_IO = {
    "in_dst_shardings": {"x": REPLICATED},
    "out_src_shardings": {TP: Partial()},
    "out_dst_shardings": REPLICATED,
    "local_map": LocalMapConfig(in_grad_placements={"x": {TP: Partial()}}),
}


class Attention(Module):
    """Causal grouped-query attention with heads split over tp, on local tensors."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 128
        n_heads: int = 8
        n_kv_heads: int = 4
        sharding_config = ShardingConfig(
            state_shardings={
                "wq": {TP: Shard(0)},
                "wk": {TP: Shard(0)},
                "wv": {TP: Shard(0)},
                "wo": {TP: Shard(1)},
            },
            **BLOCK_IO,  # type: ignore[arg-type]
        )

    def __init__(self, config: Attention.Config) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        kv_width = config.n_kv_heads * self.head_dim
        self.wq = _weight(config.dim, config.dim)
        self.wk = _weight(kv_width, config.dim)
        self.wv = _weight(kv_width, config.dim)
        self.wo = _weight(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = F.linear(x, self.wq).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.wk).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.wv).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        repeat = q.shape[1] // k.shape[1]  # this rank's query heads per key/value head
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), self.wo)


class FeedForward(Module):
    """SwiGLU MLP with the hidden width split over tp, on local tensors."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 128
        hidden_dim: int = 352
        sharding_config = ShardingConfig(
            state_shardings={"w1": {TP: Shard(0)}, "w3": {TP: Shard(0)}, "w2": {TP: Shard(1)}},
            **BLOCK_IO,  # type: ignore[arg-type]
        )

    def __init__(self, config: FeedForward.Config) -> None:
        super().__init__()
        self.w1 = _weight(config.hidden_dim, config.dim)
        self.w3 = _weight(config.hidden_dim, config.dim)
        self.w2 = _weight(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class Block(Module):
    """Pre-norm residual block."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        model: LlamaConfig

    def __init__(self, config: Block.Config) -> None:
        super().__init__()
        cfg = config.model
        self.attention_norm = Norm.Config(dim=cfg.dim, eps=cfg.norm_eps).build()
        self.attention = Attention.Config(
            dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads
        ).build()
        self.ffn_norm = Norm.Config(dim=cfg.dim, eps=cfg.norm_eps).build()
        self.feed_forward = FeedForward.Config(dim=cfg.dim, hidden_dim=cfg.hidden_dim).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class NestedBlock(Block):
    """:class:`Block` as an outer ``local_map`` region: its norms, attention and MLP regions
    run inside it on plain local tensors, and so do its residual adds (no DTensor between
    them); the block crosses the DTensor boundary once each way."""

    @dataclass(kw_only=True, slots=True)
    class Config(Block.Config):
        sharding_config = ShardingConfig(
            in_dst_shardings={"x": REPLICATED},
            out_src_shardings=REPLICATED,
            local_map=LocalMapConfig(),
        )


class UserLlama(Module):
    """Embedding, blocks, final norm and output projection; embedding and output replicated."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        model: LlamaConfig
        nested: bool = False  # each block an outer region of its regions (NestedBlock)
        sharding_config = ShardingConfig(
            state_shardings={"tok_embeddings.weight": REPLICATED, "output": REPLICATED},
            in_dst_shardings={"tokens": REPLICATED},  # the same token ids on every rank
        )

    # The whole model one outer region: every block's regions inner, the embedding, the
    # residual stream and the output projection plain; only the logits are a DTensor.
    REGION = ShardingConfig(
        state_shardings={"tok_embeddings.weight": REPLICATED, "output": REPLICATED},
        in_dst_shardings={"tokens": REPLICATED},
        out_src_shardings=REPLICATED,
        local_map=LocalMapConfig(),
    )

    def __init__(self, config: UserLlama.Config) -> None:
        super().__init__()
        cfg = config.model
        self.tok_embeddings = torch.nn.Embedding(cfg.vocab, cfg.dim)
        block = NestedBlock.Config if config.nested else Block.Config
        self.layers = torch.nn.ModuleList(block(model=cfg).build() for _ in range(cfg.n_layers))
        self.norm = Norm.Config(dim=cfg.dim, eps=cfg.norm_eps).build()
        self.output = _weight(cfg.vocab, cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self.output)


class UserModelStep:
    """A train step of the parallelized user model (the bench's ``TrainStep``)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        full_weights: Mapping[str, torch.Tensor],
        ctx: TPContext,
        *,
        nested: bool = False,
        region: bool = False,
    ) -> None:
        cfg.check_tensor_parallel(ctx.world_size)
        mesh = init_device_mesh(ctx.device_type, (ctx.world_size,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            if region:
                model = UserLlama.Config(model=cfg, sharding_config=UserLlama.REGION).build()
            else:
                model = UserLlama.Config(model=cfg, nested=nested).build()
        model.parallelize(mesh)
        model.to_empty(device=ctx.device_type)
        weights = {_our_name(name): w for name, w in full_weights.items()}
        model.load_state_dict(weights, strict=True)
        self.model = model
        self.params = dict(model.named_parameters())

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward to the mean cross-entropy loss."""
        logits: torch.Tensor = self.model(tokens)
        return cross_entropy(logits, targets)

    def zero_grad(self) -> None:
        """Drop every gradient."""
        zero_grads(self.params)

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (DTensors), for an optimizer."""
        return list(self.params.values())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient as a full tensor, under the bench's parameter names (collective)."""
        return {_bench_name(name): g for name, g in full_grads(self.params).items()}


_PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def _our_name(bench_name: str) -> str:
    """``layers.0.attention.wq.weight`` (bench) -> ``layers.0.attention.wq`` (a bare Parameter)."""
    module, _, leaf = bench_name.rpartition(".")
    return module if module.rsplit(".", 1)[-1] in _PROJECTIONS and leaf == "weight" else bench_name


def _bench_name(name: str) -> str:
    return f"{name}.weight" if name.rsplit(".", 1)[-1] in _PROJECTIONS else name


def build_user_model_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(e): a user-written 2-level Module model with local_map blocks.

    Example:
        >>> step = build_user_model_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return UserModelStep(cfg, full_weights, ctx)


def build_user_model_compiled_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(g): (e) with every local_map block's local math compiled (``compile_local_maps``).

    Example:
        >>> step = build_user_model_compiled_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    step = UserModelStep(cfg, full_weights, ctx)
    compile_local_maps(step.model)
    return step


def build_user_model_compiled_blocks_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(g'): (e) with the attention and MLP blocks compiled, the norms eager.

    Each compiled region costs torch's compiled-function runtime (dynamo's frame entry,
    AOTAutograd's wrappers, inductor's call) about 250 Python calls per forward and
    backward, whatever its size; a norm's math saves less than that, a block's more.

    Example:
        >>> step = build_user_model_compiled_blocks_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    step = UserModelStep(cfg, full_weights, ctx)
    for layer in step.model.layers:
        compile_local_maps(layer.attention)
        compile_local_maps(layer.feed_forward)
    return step


def build_user_model_nested_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(n): (e) with each block an outer region (:class:`NestedBlock`): its norms, attention
    and MLP are inner regions on plain local tensors, with no DTensor between them.

    Example:
        >>> step = build_user_model_nested_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return UserModelStep(cfg, full_weights, ctx, nested=True)


def build_user_model_nested_compiled_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(n'): (n) with each whole block compiled (``compile_local_maps`` on the outer
    regions only): one compiled region per block, its inner collectives traced into it.

    Example:
        >>> step = build_user_model_nested_compiled_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    step = UserModelStep(cfg, full_weights, ctx, nested=True)
    for layer in step.model.layers:
        plan = layer._hp_forward_plan
        assert plan is not None
        object.__setattr__(layer, "_hp_forward_plan", dataclasses.replace(plan, compile=True))
    return step


def build_user_model_region_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(m): (e) with the whole model one outer region: embedding, residual stream, norms and
    output projection on plain local tensors, every block's regions inner; the logits
    leave as a DTensor for the loss.

    Example:
        >>> step = build_user_model_region_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return UserModelStep(cfg, full_weights, ctx, region=True)


def build_user_model_region_compiled_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> UserModelStep:
    """(m'): (m) compiled as one region (the model's forward, inner collectives traced).

    Example:
        >>> step = build_user_model_region_compiled_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    step = UserModelStep(cfg, full_weights, ctx, region=True)
    plan = step.model._hp_forward_plan
    assert plan is not None
    object.__setattr__(step.model, "_hp_forward_plan", dataclasses.replace(plan, compile=True))
    return step
