"""Shape and indexing ops on DTensors equal the ops on full tensors, forward and backward.

view, reshape, flatten, transpose, permute, t, contiguous, expand, squeeze,
unsqueeze, split, chunk, cat, stack, slicing, ``x[..., idx]`` (``index.Tensor``),
``index_put``, gather: every dim sharded, uneven sizes, Partial inputs (all of
these are linear).
"""

from __future__ import annotations

import torch
from tests._harness import world_sizes
from tests.dtensor._op_oracle import OpCase, rand_shape, run_cases, shard_layouts

from hyper_parallel.dtensor import Partial, Replicate, Shard

_R = Replicate()
_P = Partial()


def _layouts(ndim: int) -> list[tuple[Shard | Replicate | Partial]]:
    return [(p,) for p in shard_layouts(ndim, partial=True)]  # type: ignore[misc]


def _set_last_dim(t: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[..., i] = v
    return out


def view_cases() -> list[OpCase]:
    """Every shape/indexing case (built on each rank from a fixed seed)."""
    gen = torch.Generator().manual_seed(17)
    a, b, c = rand_shape(gen, 3, 2, 6)
    x = torch.randn(a, b, c, generator=gen)
    even = torch.randn(4, 6, 8, generator=gen)  # splits evenly on 2 and 4 ranks
    lay3 = _layouts(3)
    y = torch.randn(a, b, c, generator=gen)
    idx = torch.randint(0, c, (5,), generator=gen)
    rows = torch.randint(0, a, (2, 3), generator=gen)
    single = torch.randn(a, 1, c, generator=gen)
    cases = [
        OpCase("view_merge_last", lambda t: t.view(a, b * c), (x,), lay3),
        OpCase("view_merge_first", lambda t: t.view(a * b, c), (x,), lay3),
        OpCase("view_split_even", lambda t: t.view(4, 3, 2, 8), (even,), _layouts(3)),
        OpCase("view_heads", lambda t: t.view(4, 6, 2, 4), (even,), _layouts(3)),
        OpCase(
            "reshape_after_transpose", lambda t: t.transpose(0, 1).reshape(b, a * c), (x,), lay3
        ),
        OpCase("flatten", lambda t: t.flatten(0, 1), (x,), lay3),
        OpCase("unflatten", lambda t: t.unflatten(1, (2, 3)), (even,), _layouts(3)),
        OpCase("transpose", lambda t: t.transpose(0, 2), (x,), lay3),
        OpCase("permute", lambda t: t.permute(2, 0, 1), (x,), lay3),
        OpCase("t", lambda t: t[0].t(), (x,), lay3),
        OpCase("contiguous", lambda t: t.transpose(1, 2).contiguous(), (x,), lay3),
        OpCase("expand", lambda t: t.expand(a, 4, c), (single,), _layouts(3)),
        OpCase("expand_new_dim", lambda t: t.expand(2, a, b, c), (x,), lay3),
        OpCase("squeeze", lambda t: t.squeeze(1), (single,), _layouts(3)),
        OpCase("unsqueeze", lambda t: t.unsqueeze(1), (x,), lay3),
        OpCase("split", lambda t: t.split(2, dim=2), (x,), lay3),
        OpCase("chunk", lambda t: t.chunk(2, dim=1), (x,), lay3),
        # unbind along a sharded dim raises, as torch (test_torch_fidelity_ops.py)
        OpCase("unbind", lambda t: t.unbind(0), (x,), [lo for lo in lay3 if lo != (Shard(0),)]),
        OpCase("narrow", lambda t: t.narrow(2, 1, c - 1), (x,), lay3),
        OpCase("slice_step", lambda t: t[:, ::2], (x,), lay3),
        OpCase("select", lambda t: t[:, 1], (x,), lay3),
        OpCase(
            "index_last",
            lambda t, i: t[..., i],
            (x, idx),
            [(p, _R) for (p,) in lay3] + [(_R, Shard(0))],
        ),
        OpCase(
            "index_first",
            lambda t, i: t[i],
            (x, rows),
            [(p, _R) for (p,) in lay3] + [(_R, Shard(0)), (_R, Shard(1))],
        ),
        OpCase(
            "index_select", lambda t, i: t.index_select(2, i), (x, idx), [(p, _R) for (p,) in lay3]
        ),
        OpCase(
            "gather",
            lambda t, i: t.gather(2, i),
            (x, torch.randint(0, c, (a, b, 2), generator=gen)),
            [(Shard(0), Shard(0)), (Shard(1), Shard(1)), (Shard(2), _R), (_P, _R)],
        ),
        OpCase(
            "cat",
            lambda s, t: torch.cat([s, t], dim=1),
            (x, y),
            [(Shard(0), Shard(0)), (Shard(1), Shard(1)), (Shard(2), _R), (_P, _P), (_R, _R)],
        ),
        OpCase(
            "stack",
            lambda s, t: torch.stack([s, t], dim=1),
            (x, y),
            [(Shard(0), Shard(0)), (Shard(1), Shard(1)), (Shard(2), Shard(2)), (_P, _P)],
        ),
        OpCase(
            "index_put_accumulate",
            lambda t, i, v: t.index_put((i,), v, accumulate=True),
            (x, torch.tensor([0, a - 1, 0]), torch.randn(3, b, c, generator=gen)),
            [
                (Shard(1), _R, Shard(1)),
                (Shard(2), _R, _R),
                (_R, _R, _R),
                (_P, _R, _P),
                (Shard(0), _R, _R),
            ],
        ),
        OpCase(
            "index_put_last_dim",
            _set_last_dim,
            (x, torch.tensor([c - 1, 0]), torch.randn(a, b, 2, generator=gen)),
            [(Shard(0), _R, Shard(0)), (Shard(1), _R, Shard(1)), (Shard(2), _R, _R)],
            rule=None,  # writing a Shard(2) target along dim 2: the fallback keeps Shard(2)
        ),
    ]
    return cases


@world_sizes(2, 4)
def test_shape_and_index_ops_match_full_tensors(world_size: int) -> None:
    run_cases(view_cases, world_size)
