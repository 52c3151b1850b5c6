"""A torch tensor-parallel training script, switched to hp-dtensor by changing its imports.

    uv run examples/torch_tp_port.py                 # 2 CPU ranks (gloo), 5 steps
    uv run examples/torch_tp_port.py --world-size 4 --steps 10

``train`` is ordinary torch TP code (a small Llama-style model, torchtitan's plan:
sequence parallel between blocks, vocab-sharded logits with loss parallel, AdamW). It
reaches DTensor only through two namespaces, exactly the two imports a port changes::

    # torch                                            # hp-dtensor
    import torch.distributed.tensor as dtensor         import hyper_parallel.dtensor as dtensor
    import torch.distributed.tensor.parallel as tp     import hyper_parallel.dtensor.parallel as tp

The script runs it once with each pair on the same seed and data and prints each
step's loss beside torch's. Under ``torchrun`` it runs on the launched ranks.
"""

from __future__ import annotations

import argparse
import os
from types import ModuleType

import torch
import torch.distributed as dist
import torch.distributed.tensor as torch_dtensor
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn

import hyper_parallel.dtensor as hp_dtensor
import hyper_parallel.dtensor.parallel as hp_tp

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # after ColwiseParallel each rank holds its heads: -1 is the local head count
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return out


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 4 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.output(self.norm(h))
        return out


def train(dtensor: ModuleType, tp: ModuleType, steps: int) -> list[float]:
    """torch TP training code; ``dtensor``/``tp`` are the only names a port changes."""
    Shard, Replicate = dtensor.Shard, dtensor.Replicate
    mesh = dtensor.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Transformer()
    tp.parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": tp.RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            "layers.*.attention_norm": tp.SequenceParallel(),
            "layers.*.attention": tp.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "layers.*.attention.w[qkv]": tp.ColwiseParallel(),
            "layers.*.attention.wo": tp.RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.ffn_norm": tp.SequenceParallel(),
            "layers.*.feed_forward": tp.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "layers.*.feed_forward.w[13]": tp.ColwiseParallel(),
            "layers.*.feed_forward.w2": tp.RowwiseParallel(output_layouts=Shard(1)),
            "norm": tp.SequenceParallel(),
            "output": tp.ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        },
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # one batch, learnt by heart: the loss falls
    losses: list[float] = []
    for _ in range(steps):
        optimizer.zero_grad()
        with tp.loss_parallel():  # the vocab-sharded logits are never gathered
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())
    return losses


def both(steps: int) -> tuple[list[float], list[float]]:
    """On every rank: the same training on torch's DTensor, then on hp's."""
    return train(torch_dtensor, torch_tp, steps), train(hp_dtensor, hp_tp, steps)


def report(torch_losses: list[float], hp_losses: list[float]) -> None:
    print(f"{'step':>4}  {'torch loss':>12}  {'hp-dtensor loss':>16}  {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(torch_losses, hp_losses, strict=True)):
        print(f"{step:>4}  {a:>12.6f}  {b:>16.6f}  {abs(a - b):>9.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to start")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        torch_losses, hp_losses = both(args.steps)
        if dist.get_rank() == 0:
            report(torch_losses, hp_losses)
        dist.destroy_process_group()
        return
    from hyper_parallel.platform_torch.launch import run_distributed

    torch_losses, hp_losses = run_distributed(
        both, args.world_size, args=(args.steps,), timeout_s=600
    )[0]
    report(torch_losses, hp_losses)


if __name__ == "__main__":
    main()
