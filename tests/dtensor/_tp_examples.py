"""PyTorch's tensor-parallel examples, written once against a TP API namespace.

The same model code and plans run on torch's ``torch.distributed.tensor`` (:data:`TORCH`)
and on hp-dtensor (:data:`HP`): only the namespace differs, as a user switching
imports would see. The models follow pytorch/examples' ``distributed/tensor_parallelism``
and torch's own TP tests: a two-layer MLP, a Transformer block with attention, and a
Llama-style model (RMSNorm, rotary attention, SwiGLU) with sequence and loss parallel.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed.tensor as torch_dt
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

import hyper_parallel.dtensor as hp_dt
import hyper_parallel.dtensor.parallel as hp_tp

__all__ = [
    "HP",
    "TORCH",
    "Api",
    "Llama",
    "MLP",
    "TransformerBlock",
    "collective_counts",
    "llama_plan",
    "mlp_plan",
    "transformer_block_plan",
]


@dataclass(frozen=True)
class Api:
    """A DTensor package and its TP package: torch's or hp's."""

    name: str
    dtensor: ModuleType
    parallel: ModuleType
    comm_debug_mode: type[Any]


TORCH = Api("torch", torch_dt, torch_tp, TorchCommDebugMode)
HP = Api("hp", hp_dt, hp_tp, hp_dt.CommDebugMode)

# torch's CommDebugMode keys its counts by collective op; hp's by kind.
_TORCH_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
}


def collective_counts(comm: Any) -> dict[str, int]:
    """Collectives by kind (``all_gather``, ``all_reduce``, ...) from either side's CommDebugMode."""
    if isinstance(comm, hp_dt.CommDebugMode):
        return comm.counts()
    counts: Counter[str] = Counter()
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        counts[_TORCH_KINDS.get(name, name)] += n
    return dict(counts)


# -- MLP (pytorch/examples tensor_parallel_example.py) --------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = 10, hidden: int = 32, out: int = 6) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))  # type: ignore[no-any-return]


def mlp_plan(api: Api) -> dict[str, Any]:
    tp = api.parallel
    return {"in_proj": tp.ColwiseParallel(), "out_proj": tp.RowwiseParallel()}


# -- Transformer block with attention (torch's test Transformer, local_output_for_attn) -------


class Attention(nn.Module):
    """Multi-head attention on this rank's heads: the projections return local tensors.

    (torch DTensor cannot shard attention itself on CPU: it has no rule for the fused
    CPU kernel, and its math form needs strided shards hp-dtensor does not have.)
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 16, n_heads: int = 4) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = nn.Sequential()
        self.feed_forward.add_module("w1", nn.Linear(dim, 4 * dim))
        self.feed_forward.add_module("gelu", nn.GELU())
        self.feed_forward.add_module("w2", nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))  # type: ignore[no-any-return]


def transformer_block_plan(api: Api) -> dict[str, Any]:
    tp = api.parallel
    return {
        "attention.w[qkv]": tp.ColwiseParallel(),
        "attention.wo": tp.RowwiseParallel(),
        "feed_forward.w1": tp.ColwiseParallel(),
        "feed_forward.w2": tp.RowwiseParallel(),
    }


# -- Llama-style model (torchtitan's plan: sequence parallel, loss parallel) -----------------


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``(batch, seq, heads, head_dim)`` by ``angles`` ``(seq, head_dim / 2)``."""
    cos = angles.cos()[None, :, None, :]
    sin = angles.sin()[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaAttention(nn.Module):
    """Attention on local heads: the projections return local tensors (``view(..., -1, hd)``)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, angles), _rotate(k, angles)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), angles)
        return h + self.feed_forward(self.ffn_norm(h))  # type: ignore[no-any-return]


class Llama(nn.Module):
    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        n_heads: int = 4,
        hidden: int = 32,
        n_layers: int = 2,
        max_seq: int = 16,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
        self.register_buffer("angles", angles, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        angles: torch.Tensor = self.angles[: tokens.shape[1]]  # type: ignore[index]
        for layer in self.layers:
            h = layer(h, angles)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def llama_plan(api: Api) -> dict[str, Any]:
    """torchtitan's Llama plan: sequence parallel between blocks, vocab-sharded logits."""
    tp, dt = api.parallel, api.dtensor
    Shard, Replicate = dt.Shard, dt.Replicate
    return {
        "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": tp.SequenceParallel(),
        "output": tp.ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "layers.*.attention_norm": tp.SequenceParallel(),
        "layers.*.attention": tp.PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.w[qkv]": tp.ColwiseParallel(),
        "layers.*.attention.wo": tp.RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": tp.SequenceParallel(),
        "layers.*.feed_forward": tp.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w[13]": tp.ColwiseParallel(),
        "layers.*.feed_forward.w2": tp.RowwiseParallel(output_layouts=Shard(1)),
    }
