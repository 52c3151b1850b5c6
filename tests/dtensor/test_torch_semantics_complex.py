"""Complex DTensors are exact and stay sharded (ported from torch's DTensor complex tests).

``conj`` is lazy in torch: it returns a view with the conjugate bit set. A DTensor
holding such a view must carry the bit too, or later ops read the unconjugated
memory. Oracles: the same computation on full tensors in one process (values), and
``torch.distributed.tensor`` on the same inputs (placements and collective counts).
"""

from __future__ import annotations

from typing import Any

import torch
from tests._harness import run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale
from tests.dtensor._torch_twin import Side, close, full, layout, sides

from hyper_parallel.dtensor import fallback_counts, reset_fallback_counts


def _complex(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.cfloat, generator=torch.Generator().manual_seed(seed))


_ELEMENTWISE: dict[str, Any] = {
    "conj": lambda c: c.conj(),
    "conj_plus_one": lambda c: c.conj() + 1,
    "conj_sum": lambda c: c.conj().sum(),
    "conj_times_self": lambda c: c.conj() * c,
    "conj_conj": lambda c: c.conj().conj() + 0,
    "neg_of_conj": lambda c: -c.conj(),
    "conj_physical": lambda c: c.conj_physical(),
    "resolve_conj": lambda c: c.conj().resolve_conj(),
    "view_as_real": lambda c: torch.view_as_real(c),
    "view_as_real_of_resolved_conj": lambda c: torch.view_as_real(c.conj().resolve_conj()),
    "view_as_complex": lambda c: torch.view_as_complex(torch.view_as_real(c) * 2),
    "abs": lambda c: c.abs(),
    "real_imag": lambda c: c.real * c.imag,
    "conj_view": lambda c: c.conj().reshape(-1) * 2,
}


def _complex_elementwise(side: Side, world_size: int) -> dict[str, Any]:
    x = _complex(4, world_size * 2, 3)
    out: dict[str, Any] = {}
    reset_fallback_counts()
    for placement in (side.Shard(0), side.Shard(1), side.Replicate()):
        c = side.distribute(x, [placement])
        for name, fn in _ELEMENTWISE.items():
            key = f"{name} {placement}"
            try:
                with side.comm() as counts:
                    got = fn(c)
            except NotImplementedError as exc:  # torch has no rule for it: nothing to compare
                assert side.name == "torch", exc
                out[key] = {"unsupported": str(exc).splitlines()[0]}
                continue
            value = full(got)
            want = fn(x)
            out[key] = {
                "close": close(value.resolve_conj(), want.resolve_conj()),
                "layout": layout(got),
                "comm": counts,
                "is_conj": got.is_conj(),
            }
    out["fallbacks"] = fallback_counts() if side.name == "hp" else {}
    return out


def _rope_freqs_cis(side: Side, world_size: int) -> dict[str, Any]:
    """TorchTitan's complex RoPE with heads sharded: forward and backward."""
    bsz, seq, heads, head_dim = 2, 5, 2 * world_size, 6
    gen = torch.Generator().manual_seed(1)
    xq_full = torch.randn(bsz, seq, heads, head_dim, generator=gen)
    angles = torch.outer(torch.arange(seq).float(), torch.rand(head_dim // 2, generator=gen))
    freqs_full = torch.polar(torch.ones_like(angles), angles)  # complex (seq, head_dim/2)
    weight = torch.randn(bsz, seq, heads, head_dim, generator=gen)

    def rope(xq: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        freqs = freqs.view(1, seq, 1, head_dim // 2)
        return torch.view_as_real(xq_ * freqs).flatten(3)

    leaf_full = xq_full.clone().requires_grad_()
    freqs_leaf_full = freqs_full.clone().requires_grad_()
    want = rope(leaf_full, freqs_leaf_full)
    (want * weight).sum().backward()  # type: ignore[no-untyped-call]

    xq = side.distribute(xq_full, [side.Shard(2)]).requires_grad_()
    freqs = side.distribute(freqs_full, [side.Replicate()]).requires_grad_()
    w = side.distribute(weight, [side.Shard(2)])
    reset_fallback_counts()
    with side.comm() as forward_comm:
        got = rope(xq, freqs)
    with side.comm() as backward_comm:
        (got * w).sum().backward()
    assert xq.grad is not None and freqs.grad is not None
    assert leaf_full.grad is not None and freqs_leaf_full.grad is not None
    failures = []
    for what, g, f in (
        ("output", full(got), want.detach()),
        ("xq.grad", full(xq.grad), leaf_full.grad),
        ("freqs_cis.grad", full(freqs.grad), freqs_leaf_full.grad),
    ):
        try:
            assert_close_to_scale(g, f, what=what)
        except AssertionError as exc:
            failures.append(str(exc).splitlines()[0])
    return {
        "failures": failures,
        "layout": layout(got),
        "grad_layouts": layout([xq.grad, freqs.grad]),
        "forward_comm": forward_comm,
        "backward_comm": backward_comm,
        "fallbacks": fallback_counts() if side.name == "hp" else {},
    }


def _on_both(scenario: Any, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    ours, theirs = sides((world_size,))
    return scenario(ours, world_size), scenario(theirs, world_size)


@world_sizes(2, 4)
def test_complex_conj_and_views_are_exact_and_stay_sharded_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_on_both, world_size, _complex_elementwise, world_size):
        assert ours.pop("fallbacks") == {}
        theirs.pop("fallbacks")
        wrong = [k for k, v in ours.items() if not v["close"]]
        assert not wrong, f"wrong values: {wrong}"
        supported = {k: v for k, v in theirs.items() if "unsupported" not in v}
        assert all(v["close"] for v in supported.values())  # the oracle agrees with torch
        assert len(supported) >= len(ours) - 3, theirs  # torch lacks only a few (conj_physical)
        for key, mine in ours.items():
            if key not in supported:
                continue
            assert mine["layout"] == theirs[key]["layout"], (key, mine, theirs[key])
            assert mine["is_conj"] == theirs[key]["is_conj"], (key, mine, theirs[key])
            assert mine["comm"] == theirs[key]["comm"], (key, mine, theirs[key])


@world_sizes(2, 4)
def test_complex_rope_forward_backward_heads_sharded_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_on_both, world_size, _rope_freqs_cis, world_size):
        assert ours["failures"] == [], ours["failures"]
        assert ours["fallbacks"] == {}
        assert ours["layout"] == theirs["layout"] == ((("S", 2),))
        assert ours["forward_comm"] == theirs["forward_comm"] == {}
        # as torch, the replicated freqs_cis keeps its Partial gradient: no collective
        assert theirs["grad_layouts"] == [(("S", 2),), (("P", "sum"),)]
        assert ours["grad_layouts"] == theirs["grad_layouts"]
        assert ours["backward_comm"] == theirs["backward_comm"]
