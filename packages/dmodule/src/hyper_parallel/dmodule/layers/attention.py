"""Grouped-query causal self-attention with rotary position embeddings, heads sharded over ``tp``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule.context_parallel import (
    CP_ALGORITHMS,
    ContextParallel,
    TokenLayout,
    attend,
)
from hyper_parallel.dmodule.layers._common import block_sharding
from hyper_parallel.dmodule.layers.linear import Linear
from hyper_parallel.dmodule.layers.rope import RopeScaling, apply_rotary, rotary_tables
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dtensor import DTensor, Replicate

__all__ = ["Attention"]

_ROPE_BUFFERS = ("rope_cos", "rope_sin")


class Attention(Module):
    """Causal grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads.

    Projections ``wq``/``wk``/``wv`` are column parallel and ``wo`` row parallel, so each
    ``tp`` rank owns ``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value heads
    (both must divide by the ``tp`` size). The default sharding runs the forward on
    DTensors; ``sharding_config=block_sharding(local_map=True)`` runs it on plain local
    tensors (the zero-overhead path). The same forward serves both: head counts are
    read from the projections' output widths.

    Example::

        >>> attn = Attention.Config(dim=16, n_heads=4, n_kv_heads=2, max_seq_len=8).build()
        >>> attn.init_states()
        >>> attn(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim``, ``n_heads``, ``n_kv_heads`` (None: ``n_heads``), ``max_seq_len``, ``rope_theta``;
        ``use_rope=False`` leaves queries and keys unrotated.

        Example::

            >>> from hyper_parallel.dmodule.layers import block_sharding
            >>> cfg = Attention.Config(dim=64, n_heads=8, sharding_config=block_sharding(
            ...     local_map=True, replicated_states=("rope_cos", "rope_sin")))
        """

        dim: int = 64
        n_heads: int = 4
        n_kv_heads: int | None = None
        max_seq_len: int = 128
        rope_theta: float = 10000.0
        rope_scaling: RopeScaling | None = None  # Llama 3.1's llama3 scaling (None: plain RoPE)
        use_rope: bool = True
        context_parallel: str = "allgather"  # over mesh axis cp: allgather, ring or alltoall
        sharding_config = block_sharding(replicated_states=_ROPE_BUFFERS)

        def validate(self) -> None:
            """Sizes are ints >= 1 and the head counts divide (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "dim", "n_heads", "n_kv_heads", "max_seq_len")
            require_positive_float(self, "rope_theta")
            if self.context_parallel not in CP_ALGORITHMS:
                raise ConfigError(
                    f"Attention: expected context_parallel to be one of {list(CP_ALGORITHMS)}, "
                    f"found {self.context_parallel!r}",
                    path="context_parallel",
                )
            n_kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
            if self.dim % self.n_heads or self.n_heads % n_kv:
                raise ConfigError(
                    f"Attention: dim ({self.dim}) must divide by n_heads ({self.n_heads}) and "
                    f"n_heads by n_kv_heads ({n_kv})",
                    path="n_heads",
                )

        @classmethod
        def tensor_parallel(
            cls,
            *,
            local_map: bool = False,
            sequence_parallel: bool = False,
            **fields: object,
        ) -> Attention.Config:
            """A config with the tensor-parallel sharding of the given variant.

            Example::

                >>> Attention.Config.tensor_parallel(local_map=True, dim=32, n_heads=4).dim
                32
            """
            sharding = block_sharding(
                local_map=local_map,
                sequence_parallel=sequence_parallel,
                replicated_states=_ROPE_BUFFERS,
            )
            return cls(sharding_config=sharding, **fields)  # type: ignore[arg-type]

    #: Context parallelism can split this layer's sequence over ``cp`` (see
    #: :mod:`~hyper_parallel.dmodule.context_parallel`).
    supports_context_parallel = True

    def __init__(self, config: Attention.Config) -> None:
        super().__init__()
        config.validate()  # again: a config's fields may have been set after it was made
        n_kv = config.n_kv_heads if config.n_kv_heads is not None else config.n_heads
        self.config = config
        self.n_heads, self.n_kv_heads = config.n_heads, n_kv
        self.head_dim = config.dim // config.n_heads
        q_width, kv_width = config.n_heads * self.head_dim, n_kv * self.head_dim
        self.wq = Linear.Config.colwise(config.dim, q_width, states_only=True).build()
        self.wk = Linear.Config.colwise(config.dim, kv_width, states_only=True).build()
        self.wv = Linear.Config.colwise(config.dim, kv_width, states_only=True).build()
        self.wo = Linear.Config.rowwise(q_width, config.dim, states_only=True).build()
        cos, sin = rotary_tables(
            self.head_dim, config.max_seq_len, config.rope_theta, scaling=config.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        #: The ``cp`` axis this layer's sequence is split over (set by context parallelism).
        self.context_parallel: ContextParallel | None = None

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.wq.weight.device
        cos, sin = rotary_tables(
            self.head_dim,
            self.config.max_seq_len,
            self.config.rope_theta,
            device,
            scaling=self.config.rope_scaling,
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, *, layout: TokenLayout | None = None) -> torch.Tensor:
        """Causal self-attention over ``x`` of shape ``(batch, seq, dim)``.

        ``layout`` says where the tokens sit (RoPE positions, documents, the ``cp`` split);
        ``None``: one document per row, positions ``0..seq-1`` (under context parallelism:
        this rank's head-tail share of a sequence ``cp`` times longer).
        """
        batch, seq, _ = x.shape
        if layout is None and self.context_parallel is not None:
            layout = TokenLayout.build(seq * self.context_parallel.size, cp=self.context_parallel)
        full_seq = seq if layout is None else layout.seq
        if full_seq > self.config.max_seq_len:
            raise ValueError(
                f"Attention: sequence length {full_seq} exceeds max_seq_len "
                f"{self.config.max_seq_len}"
            )
        head_dim = self.head_dim
        q = self.wq(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        heads, kv_heads = q.shape[1], k.shape[1]  # local counts inside a local_map block
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(
                f"Attention: this rank holds {heads} query and {kv_heads} key/value heads; "
                f"n_heads ({self.n_heads}) and n_kv_heads ({self.n_kv_heads}) must both divide "
                "by the tp size"
            )
        if self.config.use_rope:
            positions = (
                layout.positions if layout is not None else torch.arange(seq, device=x.device)
            )
            cos, sin = self._rope_rows(positions, q)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if layout is None and heads != kv_heads:
            k, v = _repeat_kv(k, heads // kv_heads), _repeat_kv(v, heads // kv_heads)
        if layout is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(q, DTensor):
            # the masked and context-parallel paths run on this rank's heads (tp) as plain tensors
            local = attend(q.to_local(), k.to_local(), v.to_local(), layout)  # type: ignore[union-attr]
            out = DTensor.from_local(local, q.device_mesh, q.placements)
        else:
            out = attend(q, k, v, layout)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected

    def _rope_rows(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables' rows at ``positions`` (``[batch|1, seq]``), shaped ``(b, 1, seq, d/2)``."""
        rows = []
        for name in _ROPE_BUFFERS:
            table = self.get_buffer(name)
            if isinstance(table, DTensor):
                table = table.to_local()
            picked = table[positions.to(table.device)]
            picked = picked.unsqueeze(1) if picked.ndim == 3 else picked
            if isinstance(like, DTensor):
                mesh = like.device_mesh
                picked = DTensor.from_local(picked, mesh, [Replicate()] * mesh.ndim)
            rows.append(picked)
        return rows[0], rows[1]


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, kv, s, d)`` → ``(b, kv * n_rep, s, d)``, each key/value head serving ``n_rep`` queries."""
    b, kv, s, d = x.shape
    return x.unsqueeze(2).expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)
