"""Random fills of DTensors: every rank gets its slice of what one device draws for the full tensor.

``torch.manual_seed(s); w.normal_()`` on a sharded ``w`` gives each rank exactly the
values the same call gives on the full tensor, and leaves the generator where the
full-tensor call leaves it (so the next random call matches too). This holds for
``normal_``, ``uniform_``, ``bernoulli_(p)``, ``exponential_``, ``random_``,
``log_normal_``, ``cauchy_``, ``geometric_``, ``rand_like``/``randn_like``/
``randint_like``, hence for the ``torch.nn.init`` functions built on them
(``kaiming_*``, ``xavier_*``, ``trunc_normal_``) and for ``F.dropout`` on CPU
(``empty_like`` + ``bernoulli_``).

How (CPU): torch's CPU generator is a single Mersenne-Twister stream that every
kernel consumes in element order, so filling ``N`` contiguous elements equals
filling consecutive pieces in order, with one exception measured on torch 2.x:
``normal_`` of ``N >= 16`` elements fills 16-element blocks (Box-Muller on 8 pairs)
and, when ``16`` does not divide ``N``, redraws the last 16 elements from fresh
uniforms (float32/float64 first draw one uniform for each of the ``N % 16`` tail
elements and throw them away; bfloat16/float16 do not). Each rank therefore walks
the *whole* stream in pieces of at most :func:`generation_chunk` elements (a
multiple of 16), keeps the elements inside its shard and drops the rest.
Which piece layout reproduces a kernel is not assumed: it is checked once per
(op, dtype, arguments) against a one-shot fill with a private generator
(:func:`_stream_model`). When no layout matches, or the tensor is no larger than
one piece, or its global strides are not contiguous, the full tensor is drawn at
once and sliced (exact by construction).

Exact: bitwise equal values and generator state, for any mesh, any Shard /
Replicate placements (uneven and nested shards included). So replicas agree and
shards differ, as with torch's offset-based RNG tracker. An in-place fill of a
Partial DTensor raises, as in torch (it would change the target's placement);
``rand_like`` of a Partial gives a Replicate DTensor.

Seeds: the values are those of one device only if every rank's default generator
holds the same state. Before each op the ranks that must draw alike are aligned
(``_seeds.py``): the first random op on each mesh takes the state of the mesh's first
rank, and later ops whose result is replicated along some axes check (one small
all-reduce per such axis) that the ranks along them still agree, taking the first
rank's state where a per-rank reseed split them. ``manual_seed`` (torch's
``manual_seed(seed, device_mesh)``) seeds this rank and turns this off: the caller
vouches for the seeds. ``set_random_sync("stream")`` (opt-in) replaces the per-op check
by one agreed stream that later ops draw from with no collective (``_seeds.py``); every
op here hands its draw to ``_seeds.draw_aligned`` as a closure, so that mode can run it
in a fork of the generator. A user-passed ``generator=`` is never aligned (as torch).
Memory per rank: the local shard, plus one piece of ``C`` elements (default
``C = 2**18``) and its gathered copy, about ``2 * C * itemsize`` bytes (2 MiB for
float32) when the shard is one contiguous run of the flat tensor (Shard(0),
Replicate); other shards add a few transient int64 index vectors of at most ``C``
elements, about ``C * (2 * itemsize + 48)`` bytes in all (14 MiB for float32).
The one-shot fallbacks hold the full tensor: ``N <= C`` elements when it fits in
one piece, ``N`` otherwise. Time: each rank draws all ``N`` numbers, like one device.

Other devices (CUDA, NPU): their generators are counter based (CUDA: Philox with a
``(seed, offset)`` state; a kernel of ``N`` elements maps element ``i`` to a
(thread, round) pair fixed by its launch grid and advances ``offset`` by an amount
derived from that grid). Reproducing the one-device values shard by shard would
mean re-deriving the kernel's grid mapping, which torch does not expose, so on any
non-CPU device the full tensor is drawn at once and sliced (memory ``N`` elements,
exact values and offset). Ops not listed here that draw random numbers (e.g.
``bernoulli_`` with a tensor of probabilities) keep the generic fallback, which is
exact too (it fills the gathered full tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import torch

from hyper_parallel.dtensor._registry import register_special
from hyper_parallel.dtensor._seeds import draw_aligned
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_strides,
    local_shape_and_offset,
    local_shard,
    partial_to_replicate,
)
from hyper_parallel.dtensor._tensor import DTensor, dispatch_by_rules
from hyper_parallel.dtensor.placement_types import Replicate, Shard, _StridedShard
from hyper_parallel.platform import get_platform

__all__ = ["generation_chunk"]

T = TypeVar("T")

aten = torch.ops.aten

_DEFAULT_CHUNK = 1 << 18
_chunk_elements: ContextVar[int] = ContextVar("hp_random_chunk_elements", default=_DEFAULT_CHUNK)


@contextmanager
def generation_chunk(elements: int) -> Iterator[None]:
    """Draw random fills of sharded DTensors in pieces of at most ``elements`` (rounded to 16).

    Bounds the extra memory of a random fill per rank; the values do not depend on it.

    Example::

        with generation_chunk(4096):
            torch.nn.init.normal_(w)   # w: a sharded DTensor
    """
    if isinstance(elements, bool) or not isinstance(elements, int) or elements < 16:
        raise ValueError(f"generation_chunk: expected an int >= 16 elements, found {elements!r}")
    token = _chunk_elements.set(elements - elements % 16)
    try:
        yield
    finally:
        _chunk_elements.reset(token)


Fill = Callable[[torch.Tensor], object]


@dataclass(frozen=True, slots=True)
class _StreamModel:
    """How a kernel's draws for ``N`` elements split into pieces.

    ``block``: piece sizes must be multiples of it. When ``block`` does not divide
    ``N``, the last ``block`` elements are redrawn after the whole blocks, first
    discarding ``N % block`` uniforms when ``discard_tail``.
    """

    block: int
    discard_tail: bool


_CANDIDATE_MODELS = (_StreamModel(1, False), _StreamModel(16, True), _StreamModel(16, False))


def _draw_stream(
    fill: Fill,
    discard: Fill,
    n: int,
    chunk: int,
    model: _StreamModel,
    dtype: torch.dtype,
    device: torch.device,
    sink: Callable[[int, torch.Tensor], None],
) -> None:
    """Draw the ``n``-element stream in pieces, handing ``(global start, values)`` to ``sink``."""
    block = model.block
    whole = n - n % block
    step = max(block, chunk - chunk % block)
    buffer = torch.empty(min(step, max(whole, 1)), dtype=dtype, device=device)
    start = 0
    while start < whole:
        length = min(step, whole - start)
        piece = buffer[:length]
        fill(piece)
        sink(start, piece)
        start += length
    if whole != n:
        if model.discard_tail:
            discard(torch.empty(n - whole, dtype=dtype, device=device))
        tail = torch.empty(block, dtype=dtype, device=device)
        fill(tail)
        sink(n - block, tail)


def _with_generator(kwargs: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
    out = dict(kwargs)
    out["generator"] = generator
    return out


@lru_cache(maxsize=512)
def _stream_model(
    func: Any, dtype: torch.dtype, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]
) -> _StreamModel | None:
    """The first piece layout that reproduces a one-shot CPU fill (values and generator state)."""
    kw = dict(kwargs)
    for model in _CANDIDATE_MODELS:
        try:
            if _reproduces(func, dtype, args, kw, model):
                return model
        except RuntimeError:  # e.g. no uniform_ to discard with for integer dtypes
            continue
    return None


def _reproduces(
    func: Any, dtype: torch.dtype, args: tuple[Any, ...], kw: dict[str, Any], model: _StreamModel
) -> bool:
    """True when drawing in pieces per ``model`` equals one-shot fills of a few sizes."""
    for n in (16 * 4 + 5, 16 * 3 + 11, 16 * 4):
        generator = torch.Generator().manual_seed(1234 + n)
        ref = torch.empty(n, dtype=dtype)
        func(ref, *args, **_with_generator(kw, generator))
        ref_state = generator.get_state()
        generator.manual_seed(1234 + n)
        got = torch.empty(n, dtype=dtype)

        def fill(t: torch.Tensor, g: torch.Generator = generator) -> object:
            return func(t, *args, **_with_generator(kw, g))

        def discard(t: torch.Tensor, g: torch.Generator = generator) -> object:
            return t.uniform_(generator=g)

        def sink(start: int, values: torch.Tensor, out: torch.Tensor = got) -> None:
            out[start : start + values.numel()] = values

        _draw_stream(fill, discard, n, 32, model, dtype, torch.device("cpu"), sink)
        if not (torch.equal(ref, got) and torch.equal(ref_state, generator.get_state())):
            return False
    return True


class _Box:
    """This rank's shard as a box ``[offset, offset + shape)`` of the row-major global tensor."""

    def __init__(
        self, global_shape: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...]
    ):
        self.global_shape = global_shape
        self.shape = shape
        self.offset = offset
        self.global_strides = contiguous_strides(global_shape)
        self.numel = math.prod(shape)
        # one contiguous run: dims before the first partial dim hold one index, dims after are full
        first = next((d for d in range(len(shape)) if shape[d] != global_shape[d]), len(shape))
        self.contiguous = all(shape[d] <= 1 for d in range(first)) and all(
            shape[d] == global_shape[d] for d in range(first + 1, len(shape))
        )
        self.start = sum(o * s for o, s in zip(offset, self.global_strides, strict=True))

    def count_before(self, flat: int) -> int:
        """How many box elements have a global flat index below ``flat``."""
        total = math.prod(self.global_shape)
        if self.numel == 0 or flat <= 0:
            return 0
        if flat >= total:
            return self.numel
        count = 0
        inner = self.numel
        rest = flat
        for d in range(len(self.shape)):
            stride = self.global_strides[d]
            index, rest = divmod(rest, stride)
            inner //= self.shape[d]
            count += min(max(index - self.offset[d], 0), self.shape[d]) * inner
            if not self.offset[d] <= index < self.offset[d] + self.shape[d]:
                return count
        return count

    def global_index(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Global flat indices of local flat elements ``lo..hi-1``."""
        local = torch.arange(lo, hi, dtype=torch.int64, device=device)
        out = torch.zeros_like(local)
        for d in reversed(range(len(self.shape))):
            size = self.shape[d]
            out += (local.remainder(size) + self.offset[d]) * self.global_strides[d]
            local = local.div(size, rounding_mode="floor")
        return out


def _shard_box(spec: DTensorSpec) -> _Box | None:
    """The box of this rank's shard (Partial axes count as replicated), or None off the mesh."""
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    placements = partial_to_replicate(spec.placements)
    shape, offset = local_shape_and_offset(spec.shape, mesh.shape, coordinate, placements)
    return _Box(spec.shape, shape, offset)


def _draw_for(
    spec: DTensorSpec, device: torch.device, kwargs: dict[str, Any], draw: Callable[[], T]
) -> T:
    """``draw`` ``spec``'s values so that its replicas draw alike (a user's generator is theirs)."""
    if kwargs.get("generator") is not None:
        return draw()
    replicated = [axis for axis, p in enumerate(spec.placements) if not p.is_shard()]
    return draw_aligned(spec.mesh, device, replicated, draw)


def fill_shard(
    local: torch.Tensor, spec: DTensorSpec, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Fill ``local`` (this rank's shard of ``spec``) with its slice of ``func`` on the full tensor.

    Draws from the generator as it stands: the caller aligns the ranks' states first.
    """
    box = _shard_box(spec)
    if box is None or local.device.type == "meta":
        return
    meta = spec.tensor_meta
    if any(isinstance(p, _StridedShard) for p in spec.placements):  # spread positions, no box
        whole = torch.empty_strided(meta.shape, meta.stride, dtype=local.dtype, device=local.device)
        func(whole, *args, **kwargs)
        coordinate = spec.mesh.get_coordinate() or ()
        placements = partial_to_replicate(spec.placements)
        local.copy_(local_shard(whole, spec.mesh.shape, coordinate, placements))
        return
    n = math.prod(meta.shape)
    chunk = _chunk_elements.get()
    device = local.device
    model: _StreamModel | None = None
    sequential = get_platform().rng_is_sequential(device)
    if sequential and n > chunk and meta.stride == contiguous_strides(meta.shape):
        try:
            key = tuple(sorted((k, v) for k, v in kwargs.items() if k != "generator"))
            model = _stream_model(func, local.dtype, args, key)
        except TypeError:  # unhashable arguments: no cached model, draw the full tensor
            model = None
    if model is None:
        full = torch.empty_strided(meta.shape, meta.stride, dtype=local.dtype, device=device)
        func(full, *args, **kwargs)
        piece = full
        for d, (start, length) in enumerate(zip(box.offset, box.shape, strict=True)):
            if length != meta.shape[d]:
                piece = piece.narrow(d, start, length)
        local.copy_(piece)
        return
    flat = (
        local.view(-1)
        if local.is_contiguous()
        else torch.empty(box.numel, dtype=local.dtype, device=device)
    )
    generator = kwargs.get("generator")

    def fill(t: torch.Tensor) -> object:
        return func(t, *args, **kwargs)

    def discard(t: torch.Tensor) -> object:
        return t.uniform_(generator=generator)

    def sink(start: int, values: torch.Tensor) -> None:
        lo = box.count_before(start)
        hi = box.count_before(start + values.numel())
        if hi <= lo:
            return
        if box.contiguous:
            first = box.start + lo - start
            flat[lo:hi] = values[first : first + hi - lo]
        else:
            flat[lo:hi] = values[box.global_index(lo, hi, device) - start]

    _draw_stream(fill, discard, n, chunk, model, local.dtype, device, sink)
    if flat.data_ptr() != local.data_ptr() or not local.is_contiguous():
        local.copy_(flat.view(local.shape))


_RANDOM_FROM = getattr(aten.random_, "from")  # `from` is a Python keyword
_IN_PLACE_FILLS = (
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.random_.default,
    aten.random_.to,
    _RANDOM_FROM,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
)


def _in_place_fill(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    """``x.normal_()`` and kin on a DTensor ``x``: each rank fills its slice of the full draw."""
    self = args[0]
    rest = args[1:]
    if any(isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values())):
        raise TypeError(f"{func}: expected number arguments after the DTensor, found a tensor")
    spec: DTensorSpec = self._spec
    if partial_to_replicate(spec.placements) != spec.placements:
        # torch's message: a fill would turn the Partial target into a Replicate one
        raise RuntimeError(
            f"{func}: in-place operations that require placement changes are not supported. "
            f"The input has placements {spec.placements}; a random fill would make them "
            "Replicate. Redistribute the DTensor (e.g. .redistribute(placements=[Replicate()])) "
            "or fill a new one"
        )
    local = self._local_tensor
    _draw_for(spec, local.device, kwargs, lambda: fill_shard(local, spec, func, rest, kwargs))
    return self  # type: ignore[no-any-return]


# rand_like & co.: (the in-place fill they equal on CPU, how to turn the call's arguments into its arguments)
_LIKE: dict[Any, tuple[Any, Callable[[tuple[Any, ...]], tuple[Any, ...]]]] = {
    aten.rand_like.default: (aten.uniform_.default, lambda a: ()),
    aten.rand_like.generator: (aten.uniform_.default, lambda a: ()),
    aten.randn_like.default: (aten.normal_.default, lambda a: ()),
    aten.randn_like.generator: (aten.normal_.default, lambda a: ()),
    aten.randint_like.default: (_RANDOM_FROM, lambda a: (0, a[0])),
    aten.randint_like.low_dtype: (_RANDOM_FROM, lambda a: (a[0], a[1])),
}


def _like_fill(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    """``torch.rand_like(x)`` and kin on a DTensor: a new DTensor laid out like ``x``, filled exactly."""
    x: DTensor = args[0]
    fill_op, to_args = _LIKE[func]
    generator = kwargs.get("generator")
    dtype = kwargs.get("dtype") or x.dtype
    device = kwargs.get("device") or x._local_tensor.device
    spec = x._spec
    placements = partial_to_replicate(spec.placements)  # a fill overwrites Partial values
    meta = TensorMeta(spec.shape, contiguous_strides(spec.shape), dtype)
    out_spec = DTensorSpec(spec.mesh, placements, meta)
    box = _shard_box(out_spec)
    local_shape = box.shape if box is not None else (0,)
    local = torch.empty(local_shape, dtype=dtype, device=device)
    fill_args = to_args(args[1:])
    _draw_for(
        out_spec,
        torch.device(device),
        kwargs,
        lambda: fill_shard(local, out_spec, fill_op, fill_args, {"generator": generator}),
    )
    return DTensor(local, out_spec)


register_special(*_IN_PLACE_FILLS)(_in_place_fill)
register_special(*_LIKE)(_like_fill)


# Random ops drawn by sharding rules or the fallback (which draws the full tensor on
# every rank, so every axis holds replicas): their ranks are aligned on every axis first.
_SEEDED_BY_RULES = (
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli.Tensor,
    aten.bernoulli_.Tensor,
    aten.native_dropout.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.poisson.default,
    aten._standard_gamma.default,
    aten.rrelu_with_noise.default,
)


def _seeded(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A random op run by its rule or the fallback, after aligning the generators of its mesh."""
    first = next(
        (a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)),
        None,
    )
    if first is None or kwargs.get("generator") is not None:
        return dispatch_by_rules(func, args, kwargs)
    mesh = first._spec.mesh
    return draw_aligned(
        mesh,
        first._local_tensor.device,
        range(mesh.ndim),
        lambda: dispatch_by_rules(func, args, kwargs),
    )


register_special(*_SEEDED_BY_RULES)(_seeded)


def _multinomial_draws(
    probs: torch.Tensor,
    k: int,
    replacement: bool,
    draw: Callable[[tuple[int, ...], bool], torch.Tensor],
) -> torch.Tensor:
    """torch's CPU ``multinomial`` from its random numbers (``draw(shape, exponential)``).

    Without replacement (or one sample) the kernel takes the top ``k`` of
    ``probs / q`` for ``q ~ Exp(1)`` of ``probs``'s shape; with replacement it draws
    ``(rows, k)`` float64 uniforms and inverts each row's cumulative distribution.
    """
    if not replacement or k == 1:
        return (probs / draw(tuple(probs.shape), True)).topk(k, dim=-1).indices
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    uniforms = draw((probs.shape[0], k), False)
    return torch.searchsorted(cdf, uniforms).clamp_(max=probs.shape[-1] - 1)


@lru_cache(maxsize=64)
def _multinomial_reproduced(dtype: torch.dtype, k: int, replacement: bool) -> bool:
    """True when :func:`_multinomial_draws` gives torch's CPU kernel's samples and state."""
    for seed, rows, classes in ((3, 7, 5), (4, 9, 11)):
        g = torch.Generator().manual_seed(seed)
        probs = torch.rand(rows, classes, generator=g).to(dtype)
        probs[0, 1:3] = 0  # zero-probability classes are never drawn
        if k > classes:
            return False
        g.manual_seed(seed)
        want = torch.multinomial(probs, k, replacement, generator=g)
        state = g.get_state()
        g.manual_seed(seed)

        def draw(shape: tuple[int, ...], exponential: bool, g: torch.Generator = g) -> torch.Tensor:
            if exponential:
                return torch.empty(shape, dtype=dtype).exponential_(1, generator=g)
            return torch.rand(shape, dtype=torch.float64, generator=g)

        got = _multinomial_draws(probs, k, replacement, draw)
        if not (torch.equal(got, want) and torch.equal(state, g.get_state())):
            return False
    return True


def _multinomial(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``multinomial`` of row-sharded probabilities stays ``Shard(0)``: each rank samples its rows.

    The random numbers are this rank's slice of the one-device draw, so the samples
    are those of one device (checked once against torch's kernel; otherwise the
    fallback, which samples the gathered tensor).
    """
    x: DTensor = args[0]
    k = int(args[1] if len(args) > 1 else kwargs["num_samples"])
    replacement = bool(args[2] if len(args) > 2 else kwargs.get("replacement", False))
    spec = x._spec
    rows_only = all(p == Replicate() or p == Shard(0) for p in spec.placements)
    local = x._local_tensor
    if not (
        rows_only
        and spec.ndim == 2
        and kwargs.get("generator") is None
        and get_platform().rng_is_sequential(local.device)
        and _multinomial_reproduced(local.dtype, k, replacement)
    ):
        return _seeded(func, args, kwargs)
    mesh = spec.mesh

    def draw(local_shape: tuple[int, ...], exponential: bool) -> torch.Tensor:
        # this rank's slice of the one-device draw for the global rows
        shape = tuple(spec.shape) if exponential else (spec.shape[0], k)
        dtype = local.dtype if exponential else torch.float64
        draw_spec = DTensorSpec(
            mesh, spec.placements, TensorMeta(shape, contiguous_strides(shape), dtype)
        )
        box = _shard_box(draw_spec)
        values = torch.empty(box.shape if box is not None else (0,), dtype=dtype)
        if exponential:
            fill_shard(values, draw_spec, aten.exponential_.default, (1.0,), {})
        else:
            fill_shard(values, draw_spec, aten.uniform_.default, (0.0, 1.0), {})
        return values

    rows = spec.shape[0]
    out_meta = TensorMeta((rows, k), contiguous_strides((rows, k)), torch.int64)
    out_spec = DTensorSpec(mesh, spec.placements, out_meta)
    if mesh.get_coordinate() is None:
        return DTensor(torch.empty(0, dtype=torch.int64, device=local.device), out_spec)
    samples = _draw_for(
        out_spec, local.device, {}, lambda: _multinomial_draws(local, k, replacement, draw)
    )
    return DTensor(samples, out_spec)


register_special(aten.multinomial.default)(_multinomial)
