"""Run one scenario on hp-dtensor and on ``torch.distributed.tensor`` side by side.

A :class:`Side` bundles one implementation's mesh, placement classes, DTensor
constructors and comm-counting mode under the same names, so a test body written
once against ``side`` runs on both; :func:`layout` and the normalised comm counts
make the two sides' placements and collectives comparable as plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import hyper_parallel.dtensor as hp

__all__ = [
    "Case",
    "Expected",
    "Side",
    "assert_like_torch",
    "assert_scenarios_like_torch",
    "close",
    "full",
    "hp_side",
    "layout",
    "run_case",
    "run_cases_on_both",
    "sides",
    "torch_side",
]

# torch's CommDebugMode keys its counts by functional-collective op; ours by kind.
_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "scatter")


def _kind(op: Any) -> str:
    name = str(op).replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    for kind in _KINDS:
        if kind in name:
            return kind
    return name


@dataclass(frozen=True)
class Side:
    """One DTensor implementation: ``name`` is ``"hp"`` or ``"torch"``."""

    name: str
    mesh: Any
    module: Any  # hyper_parallel.dtensor or torch.distributed.tensor

    @property
    def Shard(self) -> Any:
        return self.module.Shard

    @property
    def Replicate(self) -> Any:
        return self.module.Replicate

    @property
    def Partial(self) -> Any:
        return self.module.Partial

    @property
    def DTensor(self) -> Any:
        return self.module.DTensor

    def distribute(self, t: torch.Tensor, placements: list[Any], **kwargs: Any) -> Any:
        """``distribute_tensor(t, self.mesh, placements, **kwargs)``."""
        return self.module.distribute_tensor(t, self.mesh, placements, **kwargs)

    def from_local(self, t: torch.Tensor, placements: list[Any], **kwargs: Any) -> Any:
        """``DTensor.from_local(t, self.mesh, placements, **kwargs)``."""
        return self.module.DTensor.from_local(t, self.mesh, placements, **kwargs)

    @contextmanager
    def comm(self) -> Iterator[dict[str, int]]:
        """Count the collectives of the block; the dict is filled on exit (kind -> count)."""
        counts: dict[str, int] = {}
        if self.name == "hp":
            mode: Any = hp.CommDebugMode()
        else:
            from torch.distributed.tensor.debug import CommDebugMode

            mode = CommDebugMode()  # type: ignore[no-untyped-call]
        with mode:
            yield counts
        raw = mode.counts() if self.name == "hp" else mode.get_comm_counts()
        for op, n in raw.items():
            if n:
                counts[_kind(op)] = counts.get(_kind(op), 0) + n


def hp_side(mesh_shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Side:
    """hp-dtensor over ``mesh_shape`` (collective)."""
    return Side("hp", hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names), hp)


def torch_side(mesh_shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Side:
    """torch.distributed.tensor over ``mesh_shape`` (collective)."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh

    return Side("torch", init_device_mesh("cpu", mesh_shape, mesh_dim_names=names), tdt)


def sides(mesh_shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> list[Side]:
    """Both implementations over the same ranks (collective)."""
    return [hp_side(mesh_shape, names), torch_side(mesh_shape, names)]


def layout(value: Any) -> Any:
    """Placements as comparable plain values: ``("S", 0)``, ``("SS", 0, 2)``, ``("R",)``, ``("P", "sum")``.

    A DTensor gives its placements' tuple; a list/tuple of DTensors gives a list; a
    plain tensor gives ``"plain"``.
    """
    if isinstance(value, (list, tuple)):
        return [layout(v) for v in value]
    placements = getattr(value, "placements", None)
    if placements is None:
        return "plain"
    out: list[tuple[Any, ...]] = []
    for p in placements:
        if hasattr(p, "split_factor"):  # _StridedShard (not a Shard, on either side)
            out.append(("SS", p.dim, int(p.split_factor)))
        elif p.is_shard():
            out.append(("S", p.dim))
        elif p.is_partial():
            out.append(("P", str(p.reduce_op)))
        else:
            out.append(("R",))
    return tuple(out)


def full(value: Any) -> torch.Tensor:
    """The global value of a DTensor of either side (a plain tensor is returned as is)."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()  # type: ignore[no-any-return]
    assert isinstance(value, torch.Tensor)
    return value


@dataclass(frozen=True)
class Case:
    """``fn`` applied to ``inputs`` laid out as ``kinds`` (``"S0"``, ``"R"``, ``"P"``, ``"Pavg"``, ``"Pmax"``, ``None``: plain).

    A Partial input holds its value split over the ranks (sum: unequal parts; avg:
    the value on each rank; max: the value on one rank, less elsewhere). ``backward``
    also checks the gradients of the floating inputs.
    """

    name: str
    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    kinds: tuple[str | None, ...]
    backward: bool = False


def _laid_out(side: Side, value: torch.Tensor, kind: str | None) -> Any:
    if kind is None:
        return value.clone()
    n = side.mesh.size()
    rank = side.mesh.get_local_rank()
    if kind == "P":
        part = (
            value * (rank + 1) * 2 / (n * (n + 1))
            if value.is_floating_point()
            else (value if rank == 0 else torch.zeros_like(value))
        )
        return side.from_local(part, [side.Partial()])
    if kind == "Pavg":
        return side.from_local(value.clone(), [side.Partial("avg")])
    if kind == "Pmax":
        return side.from_local(value - rank, [side.Partial("max")])
    if kind == "R":
        return side.distribute(value.clone(), [side.Replicate()])
    return side.distribute(value.clone(), [side.Shard(int(kind[1:]))])


def run_case(side: Side, case: Case) -> dict[str, Any]:
    """Run ``case`` on ``side``: layouts, collectives, values and fallbacks, or the error."""
    inputs = [_laid_out(side, v, k) for v, k in zip(case.inputs, case.kinds, strict=True)]
    leaves = [
        t.detach().requires_grad_() if case.backward and t.is_floating_point() else t
        for t in inputs
    ]
    full_leaves = [
        v.clone().requires_grad_() if case.backward and v.is_floating_point() else v.clone()
        for v in case.inputs
    ]
    hp.reset_fallback_counts()
    try:
        with side.comm() as forward:
            got = case.fn(*leaves)
        with side.comm() as backward:
            if case.backward:
                first = got[0] if isinstance(got, (list, tuple)) else got
                first.float().pow(2).sum().backward()
    except (RuntimeError, NotImplementedError) as exc:
        return {"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    want = case.fn(*full_leaves)
    if case.backward:
        first_want = want[0] if isinstance(want, (list, tuple)) else want
        first_want.float().pow(2).sum().backward()
    flat_got = list(got) if isinstance(got, (list, tuple)) else [got]
    flat_want = list(want) if isinstance(want, (list, tuple)) else [want]
    matches: list[bool] = []
    for g, w in zip(flat_got, flat_want, strict=True):
        if isinstance(w, torch.Tensor):
            matches.append(close(full(g).detach(), w.detach()))
        else:
            matches.append(g == w)
    if case.backward:
        for leaf, full_leaf in zip(leaves, full_leaves, strict=True):
            if full_leaf.grad is not None:
                matches.append(leaf.grad is not None and close(full(leaf.grad), full_leaf.grad))
    return {
        "layout": layout(got),
        "forward": forward,
        "backward": backward,
        "close": all(matches),
        "fallbacks": hp.fallback_counts() if side.name == "hp" else {},
    }


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` equals ``want`` (integers) or is within ``1e-4`` of it relative to ``want``'s scale.

    The absolute part scales with the largest magnitude of ``want``, so the check holds
    on any CPU's summation order (see ``tests/_tolerance.py``).
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not (want.is_floating_point() or want.is_complex()):
        return torch.equal(got, want)
    scale = float(want.abs().max()) if want.numel() else 0.0
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(scale, 1e-30))


Expected = tuple[Any, dict[str, int]]
"""A deliberate difference: hp-dtensor's output layout and forward collectives."""


def run_cases_on_both(cases: list[Case], world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every case on hp-dtensor and on torch over a 1-D mesh of ``world_size`` (per rank)."""
    ours, theirs = sides((world_size,))
    return (
        {case.name: run_case(ours, case) for case in cases},
        {case.name: run_case(theirs, case) for case in cases},
    )


def assert_like_torch(
    ours: dict[str, Any],
    theirs: dict[str, Any],
    different: dict[str, Expected],
    torch_lacks: frozenset[str] = frozenset(),
) -> None:
    """Every case ran through rules, with the oracle's values and torch's layout and collectives.

    ``different`` names the deliberate differences (README) and what hp-dtensor gives
    there; ``torch_lacks`` the cases torch raises for or handles differently (only the
    values are checked).
    """
    for name, mine in ours.items():
        torch_result = theirs[name]
        assert "raised" not in mine, (name, mine)
        assert mine["close"], (name, mine)
        assert mine["fallbacks"] == {}, (name, mine)
        if name in different:
            assert (mine["layout"], mine["forward"]) == different[name], (name, mine)
            assert (
                torch_result.get("layout") != mine["layout"]
                or torch_result.get("forward") != mine["forward"]
            ), (name, "not a difference", torch_result)
            continue
        if name in torch_lacks or "raised" in torch_result:
            continue
        assert mine["layout"] == torch_result["layout"], (name, mine, torch_result)
        assert mine["forward"] == torch_result["forward"], (name, mine, torch_result)


def assert_scenarios_like_torch(
    ours: dict[str, dict[str, dict[str, Any]]],
    theirs: dict[str, dict[str, dict[str, Any]]],
    different: dict[tuple[str, str], Any],
    torch_raises: frozenset[str] = frozenset(),
) -> None:
    """Scenario results (group -> case -> key -> value) of hp-dtensor equal torch's, key by key.

    A case's ``value`` must be close to its ``want`` (the one-process oracle) on both
    sides; every other key equals torch's (tensors: close), except the ``(case, key)``
    pairs of ``different`` (the README's deliberate differences), where hp gives the
    listed value and torch another. Cases in ``torch_raises`` are ones torch raises for:
    only hp's value is checked, with no forward collective.
    """
    for group, cases in ours.items():
        for case, mine in cases.items():
            torch_case = theirs[group][case]
            if case in torch_raises:
                assert "raised" in torch_case, (group, case, torch_case)
                assert close(mine["value"], mine["want"]), (group, case, mine)
                assert mine["forward"] == {}, (group, case, mine)
                continue
            if "want" in mine:
                assert close(mine["value"], mine["want"]), (group, case, mine)
                assert close(torch_case["value"], mine["want"]), (group, case, torch_case)
            for key, value in mine.items():
                if key in ("value", "want"):
                    continue
                if (case, key) in different:
                    assert value == different[case, key], (group, case, key, value)
                    assert torch_case[key] != value, (group, case, key, "not a difference")
                    continue
                if isinstance(value, torch.Tensor):
                    same = isinstance(torch_case[key], torch.Tensor) and close(
                        value, torch_case[key]
                    )
                else:
                    same = bool(value == torch_case[key])
                assert same, (group, case, key, value, torch_case[key])
