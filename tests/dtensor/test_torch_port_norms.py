"""Norms, losses outside loss parallel and foreach ops over several meshes, as torch.

Ported from torch's ``test_math_ops.py`` (layer norm and batch norm forward/backward,
``nll_loss``) and ``test_dtensor.py`` (foreach ops over DTensors on different meshes).
Each case runs on hp-dtensor and on torch.distributed.tensor with the same inputs, in
one launch of 4 ranks: values against the same computation on full tensors in one
process, placements and collective counts against torch's (each side's
``CommDebugMode``). Where hp-dtensor differs on purpose (README, "Differences from
torch"), the test pins both sides' counts and placements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import Side, close, full, layout, sides

_G = torch.Generator().manual_seed(23)
_X = torch.randn(8, 6, generator=_G) * 2 + 0.5
_W = torch.rand(6, generator=_G) + 0.5
_B = torch.randn(6, generator=_G)
_TARGET = torch.randn(8, 6, generator=_G)  # the loss weights every output differently
_LOGITS = torch.randn(8, 12, generator=_G)
_LABELS = torch.randint(0, 12, (8,), generator=_G)
_CLASS_W = torch.rand(12, generator=_G) + 0.1
_IMAGE = torch.randn(4, 5, 3, 2, generator=_G)
_PIXELS = torch.randint(0, 5, (4, 3, 2), generator=_G)


def _layer_norm(side: Side) -> dict[str, Any]:
    """torch's ``test_layer_norm_bwd``: batch-sharded input, replicated weight and bias."""
    x = side.distribute(_X.clone(), [side.Shard(0)]).requires_grad_()
    w = side.distribute(_W.clone(), [side.Replicate()]).requires_grad_()
    b = side.distribute(_B.clone(), [side.Replicate()]).requires_grad_()
    with side.comm() as forward:
        y = F.layer_norm(x, (6,), w, b)
    target = side.distribute(_TARGET.clone(), [side.Shard(0)])
    with side.comm() as backward:
        torch.autograd.backward((y * target).sum())
    leaves = [t.clone().requires_grad_() for t in (_X, _W, _B)]
    want = F.layer_norm(leaves[0], (6,), leaves[1], leaves[2])
    torch.autograd.backward((want * _TARGET).sum())
    grads = [x.grad, w.grad, b.grad]
    return {
        "layout": layout(y),
        "forward": forward,
        "backward": backward,
        "grad_layouts": layout(grads),
        "close": close(full(y).detach(), want.detach())
        and all(close(full(g), leaf.grad) for g, leaf in zip(grads, leaves, strict=True)),  # type: ignore[arg-type]
    }


def _layer_norm_steps(side: Side) -> dict[str, Any]:
    """Two AdamW steps of a layer norm's replicated weight and bias on batch shards.

    Step 1 accumulates the gradients of two microbatches; step 2 clips their norm first
    (hp's ``clip_grad_norm_``, torch's ``torch.nn.utils.clip_grad_norm_``). Each side's
    collectives are counted per backward, clip and step; values against one process.
    """
    microbatches = [(_X, _TARGET), (_TARGET * 1.5 - 0.25, _X.flip(0))]
    params = [torch.nn.Parameter(side.distribute(t.clone(), [side.Replicate()])) for t in (_W, _B)]
    ref = [torch.nn.Parameter(t.clone()) for t in (_W, _B)]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=True)
    clip: Callable[..., torch.Tensor] = (
        side.module.clip_grad_norm_ if side.name == "hp" else torch.nn.utils.clip_grad_norm_
    )
    out: dict[str, Any] = {"backward": []}

    def backward(x: torch.Tensor, target: torch.Tensor) -> None:
        x_dt, t_dt = (side.distribute(v.clone(), [side.Shard(0)]) for v in (x, target))
        with side.comm() as comms:
            y = F.layer_norm(x_dt, (6,), params[0], params[1])
            torch.autograd.backward((y * t_dt).sum())
        out["backward"].append(comms)
        torch.autograd.backward((F.layer_norm(x, (6,), ref[0], ref[1]) * target).sum())

    for x, target in microbatches:
        backward(x, target)
    out["accumulated grads"] = layout([p.grad for p in params])
    out["accumulated close"] = all(
        r.grad is not None and close(full(p.grad), r.grad) for p, r in zip(params, ref, strict=True)
    )
    with side.comm() as comms:
        opt.step()
    out["step 1"] = comms
    out["stepped grads"] = layout([p.grad for p in params])
    ref_opt.step()
    out["step 1 close"] = all(
        close(full(p).detach(), r.detach()) for p, r in zip(params, ref, strict=True)
    )
    opt.zero_grad()
    ref_opt.zero_grad()
    backward(*microbatches[1])
    with side.comm() as comms:
        norm = clip(params, 0.5)
    out["clip"] = comms
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    out["norm close"] = close(full(norm), want) and bool(want > 0.5)
    with side.comm() as comms:
        opt.step()
    out["step 2"] = comms
    ref_opt.step()
    out["step 2 close"] = all(
        close(full(p).detach(), r.detach()) for p, r in zip(params, ref, strict=True)
    )
    return out


def _nll_outside_loss_parallel(side: Side) -> dict[str, Any]:
    """``nll_loss(log_softmax(x))`` of class-sharded logits without ``loss_parallel()``."""
    out: dict[str, Any] = {}
    for reduction in ("none", "sum", "mean"):
        x = side.distribute(_LOGITS.clone(), [side.Shard(1)]).requires_grad_()
        labels = side.distribute(_LABELS.clone(), [side.Replicate()])
        with side.comm() as forward:
            loss = F.nll_loss(F.log_softmax(x, -1), labels, reduction=reduction)
        with side.comm() as backward:
            torch.autograd.backward((loss * 1.5).sum())
        leaf = _LOGITS.clone().requires_grad_()
        want = F.nll_loss(F.log_softmax(leaf, -1), _LABELS, reduction=reduction)
        torch.autograd.backward((want * 1.5).sum())
        assert x.grad is not None and leaf.grad is not None
        out[reduction] = {
            "layout": layout(loss),
            "forward": forward,
            "backward": backward,
            "grad_layout": layout(x.grad),
            "close": close(full(loss).detach(), want.detach()) and close(full(x.grad), leaf.grad),
        }
    return out


def _cross_entropy_of_batch_shards(side: Side) -> dict[str, Any]:
    """torch's ``test_nll_loss_and_cross_entropy`` on batch shards, 2-D and ``(N, C, h, w)`` logits."""
    out: dict[str, Any] = {}
    cases: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = {
        "rows": (_LOGITS, _LABELS, {}),
        "rows weighted": (_LOGITS, _LABELS, {"weight": _CLASS_W, "ignore_index": 3}),
        "2d": (_IMAGE, _PIXELS, {}),
    }
    for name, (logits, labels, kwargs) in cases.items():
        for reduction in ("mean", "sum"):
            x = side.distribute(logits.clone(), [side.Shard(0)]).requires_grad_()
            target = side.distribute(labels.clone(), [side.Shard(0)])
            ours = dict(kwargs)
            if "weight" in ours:
                ours["weight"] = side.distribute(_CLASS_W.clone(), [side.Replicate()])
            with side.comm() as forward:
                loss = F.cross_entropy(x, target, reduction=reduction, **ours)
            with side.comm() as backward:
                torch.autograd.backward(loss * 1.5)
            leaf = logits.clone().requires_grad_()
            want = F.cross_entropy(leaf, labels, reduction=reduction, **kwargs)
            torch.autograd.backward(want * 1.5)
            assert x.grad is not None and leaf.grad is not None
            out[f"{name} {reduction}"] = {
                "layout": layout(loss),
                "forward": forward,
                "backward": backward,
                "grad_layout": layout(x.grad),
                "close": close(full(loss).detach(), want.detach())
                and close(full(x.grad), leaf.grad),
            }
    return out


def _batch_norm(side: Side) -> dict[str, Any]:
    """``F.batch_norm`` forward, backward and running statistics, per input layout and mode."""
    out: dict[str, Any] = {}
    shapes = {"S0": (8, 3, 5), "S1": (4, 8, 3), "S2": (2, 3, 8), "S0 4-d": (8, 2, 3, 3)}
    for name, shape in shapes.items():
        dim = int(name[1])
        for training in (True, False):
            gen = torch.Generator().manual_seed(31)
            c = shape[1]
            x_full = torch.randn(shape, generator=gen) * 3 + 1
            target = torch.randn(shape, generator=gen)
            params = [torch.rand(c, generator=gen) + 0.5, torch.randn(c, generator=gen)]
            stats = [torch.randn(c, generator=gen), torch.rand(c, generator=gen) + 0.5]
            per_channel = [side.Shard(0)] if dim == 1 else [side.Replicate()]
            x = side.distribute(x_full.clone(), [side.Shard(dim)]).requires_grad_()
            w, b = (side.distribute(p.clone(), per_channel).requires_grad_() for p in params)
            mean, var = (side.distribute(s.clone(), per_channel) for s in stats)
            with side.comm() as forward:
                y = F.batch_norm(x, mean, var, w, b, training=training, momentum=0.3)
            target_dt = side.distribute(target, [side.Shard(dim)])
            with side.comm() as backward:
                torch.autograd.backward((y * target_dt).sum())
            leaves = [t.clone().requires_grad_() for t in (x_full, *params)]
            want = F.batch_norm(leaves[0], stats[0], stats[1], leaves[1], leaves[2], training, 0.3)
            torch.autograd.backward((want * target).sum())
            grads = [x.grad, w.grad, b.grad]
            out[f"{name} {'train' if training else 'eval'}"] = {
                "layout": layout(y),
                "forward": forward,
                "backward": backward,
                "grad_layouts": layout(grads),
                "close": close(full(y).detach(), want.detach())
                and all(close(full(g), v.grad) for g, v in zip(grads, leaves, strict=True))  # type: ignore[arg-type]
                and close(full(mean), stats[0])
                and close(full(var), stats[1]),
            }
    return out


def _batch_norm_2d(side: Side) -> dict[str, Any]:
    """Train-mode batch norm on a (dp, tp) mesh: batch split on dp, channels on tp."""
    gen = torch.Generator().manual_seed(37)
    x_full = torch.randn(8, 4, 3, generator=gen) * 2 - 1
    target = torch.randn(8, 4, 3, generator=gen)
    weight, mean, var = torch.rand(4, generator=gen) + 0.5, torch.zeros(4), torch.ones(4)
    S, R = side.Shard, side.Replicate
    x = side.distribute(x_full.clone(), [S(0), S(1)]).requires_grad_()
    w = side.distribute(weight.clone(), [R(), S(0)]).requires_grad_()
    stats = [side.distribute(t.clone(), [R(), S(0)]) for t in (mean, var)]
    target_dt = side.distribute(target, [S(0), S(1)])
    with side.comm() as forward:
        y = F.batch_norm(x, stats[0], stats[1], w, None, training=True, momentum=0.5)
    with side.comm() as backward:
        torch.autograd.backward((y * target_dt).sum())
    leaf_x, leaf_w = x_full.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.batch_norm(leaf_x, mean, var, leaf_w, None, True, 0.5)
    torch.autograd.backward((want * target).sum())
    assert x.grad is not None and w.grad is not None
    assert leaf_x.grad is not None and leaf_w.grad is not None
    return {
        "close": close(full(y).detach(), want.detach())
        and close(full(x.grad), leaf_x.grad)
        and close(full(w.grad), leaf_w.grad)
        and close(full(stats[0]), mean)
        and close(full(stats[1]), var),
        "layout": layout(y),
        "forward": forward,
        "backward": backward,
    }


def _foreach_across_meshes(side: Side) -> dict[str, Any]:
    """Optimizer-style foreach ops over parameters on mesh['tp'] and mesh['dp'].

    Element-wise lists work on both sides (each element on its own mesh); an element
    that mixes two meshes raises a ``RuntimeError`` on both.
    """
    gen = torch.Generator().manual_seed(5)
    a_full, b_full = torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    grads_full = [torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)]
    tp, dp = side.mesh["tp"], side.mesh["dp"]
    a = torch.nn.Parameter(side.module.distribute_tensor(a_full.clone(), tp, [side.Shard(0)]))
    b = torch.nn.Parameter(side.module.distribute_tensor(b_full.clone(), dp, [side.Replicate()]))
    a.grad = side.module.distribute_tensor(grads_full[0].clone(), tp, [side.Shard(0)])
    b.grad = side.module.distribute_tensor(grads_full[1].clone(), dp, [side.Replicate()])
    opt = torch.optim.AdamW([a, b], lr=0.1, weight_decay=0.1, foreach=True)
    with side.comm() as step_comm:
        opt.step()
        opt.step()
    ref = [torch.nn.Parameter(a_full.clone()), torch.nn.Parameter(b_full.clone())]
    for p, g in zip(ref, grads_full, strict=True):
        p.grad = g.clone()
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=True)
    ref_opt.step()
    ref_opt.step()
    mixed: dict[str, str] = {}
    one = side.module.distribute_tensor(torch.tensor(2.0), dp, [side.Replicate()])
    calls: dict[str, Callable[[], object]] = {
        "maximum with the other mesh's tensor": lambda: torch._foreach_maximum(
            [a.detach(), b.detach()], [b.detach(), a.detach()]
        ),
        "mul_ by a tensor on one mesh": lambda: torch._foreach_mul_([a.detach()], one),
    }
    for name, fn in calls.items():
        try:
            fn()
            mixed[name] = "ran"
        except RuntimeError as exc:
            mixed[name] = f"RuntimeError: {str(exc).splitlines()[0]}"
    return {
        "close": close(full(a).detach(), ref[0].detach())
        and close(full(b).detach(), ref[1].detach()),
        "layouts": layout([a, b]),
        "step_comm": step_comm,
        "mixed": mixed,
    }


def _both() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for side in sides((4,)):
        out[side.name] = {
            "layer_norm": _layer_norm(side),
            "layer_norm steps": _layer_norm_steps(side),
            "nll": _nll_outside_loss_parallel(side),
            "cross_entropy": _cross_entropy_of_batch_shards(side),
            "batch_norm": _batch_norm(side),
        }
    for side in sides((2, 2), ("dp", "tp")):
        out[side.name]["foreach"] = _foreach_across_meshes(side)
        out[side.name]["batch_norm 2-d"] = _batch_norm_2d(side)
    return out


def test_norms_losses_and_foreach_like_torch() -> None:
    for got in run_on_ranks(_both, 4, timeout_s=240.0):
        ours, theirs = got["hp"], got["torch"]

        # layer norm, batch-sharded: as torch, the backward issues no collective and leaves
        # the weight and bias gradients Partial
        ln, ln_t = ours["layer_norm"], theirs["layer_norm"]
        assert ln["close"] and ln_t["close"], (ln, ln_t)
        assert ln["layout"] == ln_t["layout"] == (("S", 0),)
        assert ln["forward"] == ln_t["forward"] == {}
        assert ln["backward"] == ln_t["backward"] == {}, (ln, ln_t)
        assert ln["grad_layouts"] == ln_t["grad_layouts"]
        assert ln_t["grad_layouts"] == [(("S", 0),), (("P", "sum"),), (("P", "sum"),)]

        # ... and two microbatches accumulate them locally (Partial + Partial). hp reduces
        # them once per step, both in one flat all-reduce, in place of .grad (the step's
        # pre-hook, or clip_grad_norm_ when it comes first); torch's foreach AdamW
        # all-reduces them in the ops that read them. Values: one process's, on both sides.
        st, st_t = ours["layer_norm steps"], theirs["layer_norm steps"]
        for key in ("accumulated close", "step 1 close", "norm close", "step 2 close"):
            assert st[key] and st_t[key], (key, st, st_t)
        assert st["backward"] == st_t["backward"] == [{}, {}, {}], (st, st_t)
        assert st["accumulated grads"] == st_t["accumulated grads"] == [(("P", "sum"),)] * 2
        assert st["step 1"] == {"all_reduce": 1}, st
        assert st_t["step 1"].get("all_reduce", 0) > 2, st_t
        assert st["stepped grads"] == [(("R",),)] * 2, st
        assert st["clip"] == {"all_reduce": 1} and st["step 2"] == {}, st

        # nll_loss of class-sharded log-probabilities outside loss_parallel (README):
        # torch all-gathers the logits (Replicate loss); hp keeps them sharded (the
        # log_softmax reduces its row max and sum in the kernel) and returns a Partial
        # loss, whose gradient comes back with one all-reduce.
        for reduction in ("none", "sum", "mean"):
            mine, torch_nll = ours["nll"][reduction], theirs["nll"][reduction]
            assert mine["close"] and torch_nll["close"], (reduction, mine, torch_nll)
            assert torch_nll["layout"] == (("R",),) and torch_nll["forward"] == {"all_gather": 1}
            assert torch_nll["backward"] == {}, torch_nll
            assert mine["layout"] == (("P", "sum"),), (reduction, mine)
            assert mine["forward"] == {"all_reduce": 2}, (reduction, mine)
            assert mine["backward"] == {"all_reduce": 1}, (reduction, mine)
            assert mine["grad_layout"] == (("S", 1),), (reduction, mine)

        # cross-entropy of batch shards (README): a sum is Partial, as torch, with no
        # collective; a mean divides by the global total weight (one all-reduce of a
        # scalar, Partial loss) where torch all-gathers logits and targets (Replicate
        # loss). Neither backward communicates: the forward returned that total Replicate.
        for case, mine in ours["cross_entropy"].items():
            torch_ce = theirs["cross_entropy"][case]
            assert mine["close"] and torch_ce["close"], (case, mine, torch_ce)
            assert mine["backward"] == torch_ce["backward"] == {}, (case, mine, torch_ce)
            assert mine["grad_layout"] == torch_ce["grad_layout"] == (("S", 0),), case
            assert mine["layout"] == (("P", "sum"),), (case, mine)
            if case.endswith("sum"):
                assert mine["forward"] == torch_ce["forward"] == {}, (case, mine, torch_ce)
                assert torch_ce["layout"] == mine["layout"], (case, torch_ce)
            else:
                assert mine["forward"] == {"all_reduce": 1}, (case, mine)
                assert torch_ce["forward"] == {"all_gather": 2}, (case, torch_ce)

        # batch norm: a channel shard is local, as torch. A batch or spatial shard stays
        # sharded (README): eval is local; train all-reduces the per-channel sums in the
        # kernel (2 forward, 1 backward), where torch moves the activations.
        for case, mine in ours["batch_norm"].items():
            torch_bn = theirs["batch_norm"][case]
            assert mine["close"] and torch_bn["close"], (case, mine, torch_bn)
            dim = int(case[1])
            assert mine["layout"] == ((("S", dim),)), (case, mine)
            if dim == 1:
                assert mine["forward"] == torch_bn["forward"] == {}, (case, mine, torch_bn)
                assert mine["layout"] == torch_bn["layout"], (case, mine, torch_bn)
                assert mine["backward"] == {}, (case, mine)
                assert mine["grad_layouts"] == [(("S", 1),), (("S", 0),), (("S", 0),)], mine
                if case.endswith("train"):
                    assert torch_bn["backward"] == {}, torch_bn
                    assert torch_bn["grad_layouts"] == mine["grad_layouts"], torch_bn
                else:  # torch's eval backward gathers (README)
                    assert torch_bn["backward"] != {}, torch_bn
                continue
            assert torch_bn["forward"] != {} and torch_bn["layout"] != mine["layout"], torch_bn
            if case.endswith("train"):
                assert mine["forward"] == {"all_reduce": 2}, (case, mine)
                assert mine["backward"] == {"all_reduce": 1}, (case, mine)
                # the weight and bias gradients come from the all-reduced channel sums
                grads = [(("S", dim),), (("R",),), (("R",),)]
            else:
                assert mine["forward"] == {}, (case, mine)
                assert mine["backward"] == {}, (case, mine)
                # local sums, left Partial (as torch leaves the gradient of a Replicate leaf)
                grads = [(("S", dim),), (("P", "sum"),), (("P", "sum"),)]
            assert mine["grad_layouts"] == grads, (case, mine)

        # on a (dp, tp) mesh: statistics reduced over dp only, channels local on tp
        bn2, bn2_t = ours["batch_norm 2-d"], theirs["batch_norm 2-d"]
        assert bn2["close"] and bn2_t["close"], (bn2, bn2_t)
        assert bn2["layout"] == (("S", 0), ("S", 1)), bn2
        assert bn2["forward"] == {"all_reduce": 2}, bn2
        assert bn2["backward"] == {"all_reduce": 1}, bn2

        # foreach over parameters on two meshes: an optimizer step works on both sides
        # with no collective, and an element mixing meshes raises a RuntimeError on both.
        fe, fe_t = ours["foreach"], theirs["foreach"]
        assert fe["close"] and fe_t["close"], (fe, fe_t)
        assert fe["layouts"] == fe_t["layouts"] == [(("S", 0),), (("R",),)]
        assert fe["step_comm"] == fe_t["step_comm"] == {}, (fe, fe_t)
        for name, theirs_error in fe_t["mixed"].items():
            assert theirs_error.startswith("RuntimeError"), (name, theirs_error)
            assert fe["mixed"][name].startswith("RuntimeError"), (name, fe["mixed"][name])
            assert "different meshes" in fe["mixed"][name], fe["mixed"][name]
