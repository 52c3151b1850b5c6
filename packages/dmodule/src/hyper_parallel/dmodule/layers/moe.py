"""Mixture of experts: a token-choice top-k router, SwiGLU grouped experts, and ``MoE`` with expert parallelism."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule.layers._common import normal_init
from hyper_parallel.dmodule.layers._moe_tokens import (
    EP,
    ETP,
    _axis_names,
    _gather_shares,
    _local,
    _run_experts,
    _take_share,
    _token_layout,
)
from hyper_parallel.dmodule.layers.feed_forward import FeedForward
from hyper_parallel.dmodule.layers.linear import Linear
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Placement,
    Replicate,
    Shard,
    collectives,
)

__all__ = [
    "GroupedExperts",
    "MoE",
    "TokenChoiceTopKRouter",
    "expert_sharding",
    "moe_aux_loss",
    "update_load_balance",
]


ScoreFunc = Literal["softmax", "sigmoid"]


def expert_sharding(*, etp: bool = False) -> ShardingConfig:
    """The expert-parallel layout: experts ``Shard(0)`` on ``ep``; with ``etp``, hidden units too.

    With ``etp=True``, ``w1``/``w3`` (``[E, hidden, dim]``) split their hidden dim over
    ``etp`` and ``w2`` (``[E, dim, hidden]``) its input dim, a column- then row-parallel
    pair. Without it the experts live on the 1-D ``ep`` view, with it on ``(ep, etp)``;
    ``fully_shard`` over ``efsdp`` composes with either.

    Example::

        >>> expert_sharding(etp=True).state_shardings["w2"]
        {MeshAxisName.EP: Shard(dim=0), 'etp': Shard(dim=2)}
    """
    if not etp:
        return ShardingConfig(state_shardings={name: {EP: Shard(0)} for name in ("w1", "w2", "w3")})
    return ShardingConfig(
        state_shardings={
            "w1": {EP: Shard(0), ETP: Shard(1)},
            "w2": {EP: Shard(0), ETP: Shard(2)},
            "w3": {EP: Shard(0), ETP: Shard(1)},
        }
    )


class TokenChoiceTopKRouter(Module):
    """Scores each token against every expert and picks its ``top_k`` (token choice).

    Returns ``(weights, experts, probs)``: the top-k routing weights ``[T, k]`` (float32),
    the chosen experts ``[T, k]`` and every token's probabilities over all experts
    ``[T, E]`` (for the auxiliary loss). ``expert_bias`` (aux-loss-free balancing) shifts
    which experts are chosen, never the weights.

    Example::

        >>> router = TokenChoiceTopKRouter.Config(dim=8, num_experts=4, top_k=2).build()
        >>> router.init_states()
        >>> weights, experts, probs = router(torch.randn(5, 8))
        >>> weights.shape, experts.shape, probs.shape
        (torch.Size([5, 2]), torch.Size([5, 2]), torch.Size([5, 4]))
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``score_func`` softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3).

        ``route_norm`` renormalises the top-k weights to sum to 1 (transformers'
        ``norm_topk_prob``); ``route_scale`` multiplies them afterwards.

        Example::

            >>> TokenChoiceTopKRouter.Config(num_experts=4, top_k=5).validate()
            Traceback (most recent call last):
            ...
            hyper_parallel.config.errors.ConfigError: top_k: expected at most num_experts (4), found 5
        """

        dim: int = 64
        num_experts: int = 8
        top_k: int = 2
        score_func: ScoreFunc = "softmax"
        route_norm: bool = False
        route_scale: float = 1.0

        def validate(self) -> None:
            """Sizes are ints >= 1 and ``top_k <= num_experts`` (``score_func`` is checked by its type)."""
            Module.Config.validate(self)
            _validate_routing(self)

    def __init__(self, config: TokenChoiceTopKRouter.Config) -> None:
        super().__init__()
        self.config = config
        self.gate = Linear.Config(in_features=config.dim, out_features=config.num_experts).build()

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` of shape ``[T, dim]``: top-k weights, expert ids, all probabilities."""
        cfg = self.config
        logits = self.gate(x).float()
        if cfg.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        if expert_bias is None:
            weights, experts = torch.topk(scores, cfg.top_k, dim=-1)
        else:
            _, experts = torch.topk(scores + expert_bias, cfg.top_k, dim=-1)
            weights = scores.gather(-1, experts)
        if cfg.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.route_scale != 1.0:
            weights = weights * cfg.route_scale
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return weights, experts, probs


def _validate_routing(config: Any) -> None:
    require_positive(config, "dim", "num_experts", "top_k")
    if config.top_k > config.num_experts:
        raise ConfigError(
            f"expected at most num_experts ({config.num_experts}), found {config.top_k}",
            path="top_k",
        )
    require_positive_float(config, "route_scale")


class GroupedExperts(Module):
    """``num_experts`` SwiGLU experts with stacked weights, run on tokens grouped by expert.

    ``w1``/``w3``: ``[E, hidden, dim]``, ``w2``: ``[E, dim, hidden]`` (each expert's slice is
    an ``nn.Linear`` weight). The forward takes tokens sorted by expert and the count per
    expert; it uses ``torch._grouped_mm`` on CUDA in bfloat16 where the strides allow, else
    one matmul per expert.

    Example::

        >>> experts = GroupedExperts.Config(dim=8, hidden_dim=16, num_experts=2).build()
        >>> experts.init_states()
        >>> experts(torch.randn(5, 8), torch.tensor([2, 3])).shape
        torch.Size([5, 8])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim``, ``hidden_dim`` (per expert), ``num_experts``; weights N(0, 0.02).

        Example::

            >>> GroupedExperts.Config().sharding_config.state_shardings["w1"]
            {MeshAxisName.EP: Shard(dim=0)}
        """

        dim: int = 64
        hidden_dim: int = 128
        num_experts: int = 8
        param_init = {"w1": normal_init, "w2": normal_init, "w3": normal_init}  # noqa: RUF012 - becomes a field
        sharding_config = expert_sharding()

        def validate(self) -> None:
            """Sizes are ints >= 1."""
            Module.Config.validate(self)
            require_positive(self, "dim", "hidden_dim", "num_experts")

    def __init__(self, config: GroupedExperts.Config) -> None:
        super().__init__()
        self.config = config
        e, h, d = config.num_experts, config.hidden_dim, config.dim
        self.w1 = torch.nn.Parameter(torch.empty(e, h, d))
        self.w2 = torch.nn.Parameter(torch.empty(e, d, h))
        self.w3 = torch.nn.Parameter(torch.empty(e, h, d))

    def layout_problems(self, layouts: dict[str, tuple[DeviceMesh, list[Placement]]]) -> list[str]:
        """Each rank of ``ep`` must own whole experts: ``num_experts`` divisible by its size."""
        problems = []
        for name, (mesh, placements) in sorted(layouts.items()):
            for axis, placement in zip(mesh.mesh_dim_names or (), placements, strict=False):
                size = mesh.size(list(mesh.mesh_dim_names or ()).index(axis))
                uneven = self.config.num_experts % size
                if isinstance(placement, Shard) and placement.dim == 0 and uneven:
                    problems.append(
                        f"{name}: num_experts={self.config.num_experts} is not divisible by "
                        f"the size of mesh axis {axis!r} ({size}); expected each rank to "
                        "own the same number of whole experts"
                    )
        return problems

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each token by its expert: ``x`` ``[N, dim]`` sorted by expert, ``counts`` ``[E_local]``."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        if _grouped_mm_applies(x, w1, w2):
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        outs = []
        for e, chunk in enumerate(torch.split(x, counts.tolist(), dim=0)):
            h = F.silu(chunk @ w1[e].transpose(0, 1)) * (chunk @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
        return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w2.shape[1])


def _grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch's grouped matmul: CUDA (sm90+) kernels, bfloat16, rows a multiple of 16 bytes."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False  # the kernels need Hopper or newer
    if not (x.dtype == w1.dtype == w2.dtype == torch.bfloat16):
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (w1.shape[1], w1.shape[2]))


class MoE(Module):
    """Router, routed experts (dropless top-k) and optional shared experts, with load balancing.

    Every token reaches each of its ``top_k`` experts (no capacity, nothing dropped) and
    the outputs are summed with the routing weights, plus ``shared_experts(x)`` when
    ``shared_hidden_dim > 0``. Parallelized with a :class:`ParallelDims` whose ``ep > 1``,
    tokens travel to the ranks owning their experts by all-to-all and back.

    Load balancing (both off by default, as transformers' Qwen3-MoE):

    - ``load_balance_coeff``: aux-loss-free balancing (DeepSeek-V3): a per-expert
      ``expert_bias`` added to the scores for the choice only; the forward counts tokens
      per expert in ``tokens_per_expert`` and :func:`update_load_balance` (after each
      optimizer step) moves the bias by ``coeff * sign(mean - count)`` of the global counts.
    - ``aux_loss_coeff``: the forward keeps ``aux_loss`` =
      ``coeff * E * sum_e(f_e * P_e)`` (transformers' load-balancing loss, one layer; ``f_e``
      the share of tokens routed to ``e``, ``P_e`` its mean probability; 0 when no token
      was routed); add :func:`moe_aux_loss` of the model to the training loss.

    Example::

        >>> moe = MoE.Config(dim=8, hidden_dim=16, num_experts=4, top_k=2).build()
        >>> moe.init_states()
        >>> moe(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """Routing (as :class:`TokenChoiceTopKRouter`), expert sizes, shared experts, balancing.

        ``expert_tensor_parallel``: the experts' hidden units are split over ``etp`` too
        (:func:`expert_sharding`; for ``ParallelDims(etp=tp)``).

        Example::

            >>> MoE.Config(num_experts=4, top_k=2, shared_hidden_dim=32).shared_hidden_dim
            32
        """

        dim: int = 64
        hidden_dim: int = 128
        num_experts: int = 8
        top_k: int = 2
        score_func: ScoreFunc = "softmax"
        route_norm: bool = False
        route_scale: float = 1.0
        shared_hidden_dim: int = 0
        load_balance_coeff: float | None = None
        aux_loss_coeff: float = 0.0
        expert_tensor_parallel: bool = False

        def validate(self) -> None:
            """Routing as the router's; ``hidden_dim >= 1``; coefficients finite and >= 0."""
            Module.Config.validate(self)
            _validate_routing(self)
            require_positive(self, "hidden_dim")
            if not isinstance(self.shared_hidden_dim, int) or self.shared_hidden_dim < 0:
                raise ConfigError(
                    f"expected an int >= 0 (0: no shared experts), found "
                    f"{self.shared_hidden_dim!r}",
                    path="shared_hidden_dim",
                )
            if self.load_balance_coeff is not None:
                require_positive_float(self, "load_balance_coeff")
            if not (isinstance(self.aux_loss_coeff, (int, float)) and self.aux_loss_coeff >= 0):
                raise ConfigError(
                    f"expected a float >= 0 (0: no auxiliary loss), found {self.aux_loss_coeff!r}",
                    path="aux_loss_coeff",
                )

    def __init__(self, config: MoE.Config) -> None:
        super().__init__()
        self.config = config
        self.router = TokenChoiceTopKRouter.Config(
            dim=config.dim,
            num_experts=config.num_experts,
            top_k=config.top_k,
            score_func=config.score_func,
            route_norm=config.route_norm,
            route_scale=config.route_scale,
        ).build()
        self.experts = GroupedExperts.Config(
            dim=config.dim,
            hidden_dim=config.hidden_dim,
            num_experts=config.num_experts,
            sharding_config=expert_sharding(etp=config.expert_tensor_parallel),
        ).build()
        self.shared_experts: FeedForward | None = None
        if config.shared_hidden_dim > 0:
            self.shared_experts = FeedForward.Config(
                dim=config.dim, hidden_dim=config.shared_hidden_dim
            ).build()
        self.expert_bias: torch.Tensor | None
        self.tokens_per_expert: torch.Tensor | None
        if config.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
            # A per-rank partial sum: update_load_balance sums it over the data ranks.
            self.register_buffer(
                "tokens_per_expert", torch.zeros(config.num_experts), persistent=False
            )
        else:
            self.expert_bias = None
            self.tokens_per_expert = None
        self.aux_loss: torch.Tensor | None = None

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        for name in ("expert_bias", "tokens_per_expert"):
            buf = self._buffers.get(name)
            if buf is not None:
                device = buffer_device if buffer_device is not None else buf.device
                self._buffers[name] = torch.zeros(self.config.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route every token of ``x`` (``[..., dim]``) to its top-k experts and combine.

        A DTensor ``x`` laid out over ``tp`` (``Replicate()``, or sequence-parallel
        ``Shard(1)``): the router sees every token of the ``tp`` group; when ``ep``
        borrows ``tp``'s ranks (``ParallelDims(etp=1)``) each rank runs the experts on
        its share of them only. The output keeps ``x``'s layout.
        """
        out: torch.Tensor
        if isinstance(x, DTensor):
            out = self._forward_dtensor(x)
        else:
            tokens = x.reshape(-1, self.config.dim)
            weights, chosen = self._route(tokens)
            out = self._combine(tokens, weights, chosen).reshape(x.shape)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if isinstance(shared, DTensor) and not isinstance(out, DTensor):
                shared = shared.to_local()  # parallelized on the dense view, x a plain tensor
            out = out + shared
        return out

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router on ``tokens`` ``[T, dim]``; the balance statistics count these tokens."""
        cfg = self.config
        weights, chosen, probs = self.router(tokens, _local_or_none(self.expert_bias))
        if self.tokens_per_expert is None and cfg.aux_loss_coeff == 0:
            return weights, chosen
        counts = torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts)
        if self.tokens_per_expert is not None:
            with torch.no_grad():
                _local(self.tokens_per_expert).add_(counts.to(self.tokens_per_expert.dtype))
        if cfg.aux_loss_coeff > 0:
            self.aux_loss = _load_balance_loss(counts, probs, cfg.aux_loss_coeff)
        return weights, chosen

    def _combine(
        self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """``tokens`` ``[T, dim]`` through their ``chosen`` experts, summed with ``weights``."""
        cfg = self.config
        counts = torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts)
        # token-expert pairs grouped by expert (stable: a token's copies keep token order)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        token_of = order // cfg.top_k
        routed = _run_experts(self.experts, tokens[token_of], counts)
        routed = routed * weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, routed.to(tokens.dtype))

    def _forward_dtensor(self, x: DTensor) -> DTensor:
        """The forward of a DTensor ``x``, its tokens met over ``tp`` as :func:`_token_layout` says."""
        cfg = self.config
        mesh, placements = x.device_mesh, tuple(x.placements)
        layout = _token_layout(self.experts, x)
        if layout is None:  # every rank's tokens are its own (data-parallel shards)
            local = x.to_local()
            tokens = local.reshape(-1, cfg.dim)
            weights, chosen = self._route(tokens)
            out = self._combine(tokens, weights, chosen).reshape(local.shape)
            return DTensor.from_local(out, mesh, placements, shape=x.shape, stride=x.stride())
        axis, split = layout
        whole_layout = (*placements[:axis], Replicate(), *placements[axis + 1 :])
        # The router sees every token of the tp group (sequence shards all-gathered), so its
        # gradient and the balance statistics are whole on each tp rank, as one process's.
        whole = x.redistribute(mesh, whole_layout).to_local()
        tokens = whole.reshape(-1, cfg.dim)
        weights, chosen = self._route(tokens)
        if not split:  # the experts are whole (or split by etp) on each tp rank: run them all
            out = self._combine(tokens, weights, chosen).reshape(whole.shape)
            replicated = DTensor.from_local(
                out, mesh, whole_layout, shape=x.shape, stride=x.stride()
            )
            return replicated.redistribute(mesh, placements)
        # ep borrows tp: each tp rank sends only its share of the tokens to the experts
        tp_mesh = mesh[_axis_names(mesh)[axis]]
        share = placements[axis]
        token_shape: tuple[int, ...]
        if isinstance(share, Shard):  # sequence parallel: my share is my shard
            token_shape = tuple(whole.shape[:-1])
            mine = x.to_local().reshape(-1, cfg.dim)
        else:  # replicated: the flattened tokens, in tp contiguous chunks
            share, token_shape = Shard(0), (tokens.shape[0],)
            mine = _take_share(tokens, tp_mesh, share)
        k = cfg.top_k
        my_weights = _take_share(weights.reshape(*token_shape, k), tp_mesh, share).reshape(-1, k)
        my_chosen = _take_share(chosen.reshape(*token_shape, k), tp_mesh, share).reshape(-1, k)
        out = self._combine(mine, my_weights, my_chosen)
        if placements[axis] == share:  # sequence parallel: the output stays my shard
            out = out.reshape(x.to_local().shape)
        else:
            out = _gather_shares(out, tp_mesh, share, (tokens.shape[0], cfg.dim))
            out = out.reshape(whole.shape)
        return DTensor.from_local(out, mesh, placements, shape=x.shape, stride=x.stride())


def _load_balance_loss(counts: torch.Tensor, probs: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * E * sum_e(f_e * P_e)`` over the ``T`` tokens of ``probs`` (``[T, E]``).

    No token routed (``T == 0``): 0, the value of an empty mean (no token, no imbalance),
    not the NaN of ``0 / 0`` that would poison the training loss it is added to; still
    on the router's graph, so a backward gives its weights a zero gradient.
    """
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    share = counts.to(probs.dtype) / probs.shape[0]
    return coeff * probs.shape[1] * (share * probs.mean(0)).sum()


def _local_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _local(t)


def _moe_layers(model: torch.nn.Module) -> Iterator[MoE]:
    for module in model.modules():
        if isinstance(module, MoE):
            yield module


def moe_aux_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """The sum of every ``MoE`` layer's auxiliary loss from the last forward (None: none kept).

    A layer that routed no token in its last forward adds 0 (not NaN).

    Example::

        >>> moe = MoE.Config(dim=8, hidden_dim=16, num_experts=4, aux_loss_coeff=0.01).build()
        >>> moe.init_states()
        >>> _ = moe(torch.randn(3, 8))
        >>> moe_aux_loss(moe).shape
        torch.Size([])
    """
    losses = [m.aux_loss for m in _moe_layers(model) if m.aux_loss is not None]
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def update_load_balance(
    model: torch.nn.Module, mesh: DeviceMesh | ParallelDims | None = None
) -> None:
    """Move each ``MoE`` layer's ``expert_bias`` toward balance from the global token counts.

    Call it after each optimizer step. ``tokens_per_expert`` holds this rank's counts since
    the last call (a partial sum): they are summed over every axis of ``mesh`` (a
    :class:`ParallelDims` means its ``loss`` view, the ranks that route different tokens;
    None: one process). Then ``expert_bias += coeff * sign(mean - count)`` (centred), and
    the counts restart from zero. Every rank ends with the same bias.

    Example::

        >>> moe = MoE.Config(dim=8, hidden_dim=16, num_experts=4, load_balance_coeff=1e-3).build()
        >>> moe.init_states()
        >>> _ = moe(torch.randn(3, 8))
        >>> update_load_balance(moe)
        >>> float(moe.tokens_per_expert.sum())
        0.0
    """
    layers = [m for m in _moe_layers(model) if m.tokens_per_expert is not None]
    if not layers:
        return
    if isinstance(mesh, ParallelDims):
        mesh = mesh.loss_mesh
    counts = torch.stack([_local(m.tokens_per_expert) for m in layers])  # type: ignore[arg-type]
    if mesh is not None:
        axes = [axis for axis in range(mesh.ndim) if mesh.size(axis) > 1]
        counts = collectives.all_reduce_over(counts, mesh, axes, "sum")
    with torch.no_grad():
        for layer, count in zip(layers, counts, strict=True):
            coeff = layer.config.load_balance_coeff
            assert coeff is not None and layer.expert_bias is not None
            delta = coeff * torch.sign(count.mean() - count)
            _local(layer.expert_bias).add_(delta - delta.mean())
            _local(layer.tokens_per_expert).zero_()  # type: ignore[arg-type]
