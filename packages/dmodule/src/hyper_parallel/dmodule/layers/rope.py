"""Rotary position embeddings: the inverse frequencies, the cos/sin tables, the rotation.

``RopeScaling`` is Llama 3.1's ``llama3`` frequency scaling (transformers'
``rope_type: "llama3"``): wavelengths longer than ``original_max_position_embeddings /
low_freq_factor`` are slowed by ``factor``, those shorter than ``... / high_freq_factor``
kept, and the band between interpolated smoothly. The numbers are transformers'.

On the meta device the tables are left empty (no values can live there anyway, and
``torch.arange`` on meta goes through torch's Python references, whose first use imports
``torch._dynamo``: seconds per process). ``init_states`` computes them on a real device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyper_parallel.config import ConfigError

__all__ = ["RopeScaling", "apply_rotary", "rope_inv_freq", "rotary_tables"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """Llama 3.1's ``llama3`` RoPE scaling (``rope_scaling`` of its ``config.json``).

    Example::

        >>> RopeScaling(factor=32.0).original_max_position_embeddings
        8192
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(
                    f"expected a number > 0, found {value!r}", path=f"rope_scaling.{name}"
                )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"expected high_freq_factor > low_freq_factor ({self.low_freq_factor}), found "
                f"{self.high_freq_factor}",
                path="rope_scaling.high_freq_factor",
            )
        original = self.original_max_position_embeddings
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ConfigError(
                f"expected an int >= 1, found {original!r}",
                path="rope_scaling.original_max_position_embeddings",
            )

    def to_hf(self) -> dict[str, float | int | str]:
        """The ``rope_scaling`` entry of transformers' ``config.json``.

        Example::

            >>> RopeScaling().to_hf()["rope_type"]
            'llama3'
        """
        return {
            "rope_type": "llama3",
            "factor": float(self.factor),
            "low_freq_factor": float(self.low_freq_factor),
            "high_freq_factor": float(self.high_freq_factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (transformers' ``_compute_llama3_parameters``)."""
        factor = float(self.factor)
        low, high = float(self.low_freq_factor), float(self.high_freq_factor)
        old_context = float(self.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)


def _on_meta(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.get_default_device().type == "meta"
    return torch.device(device).type == "meta"


def rope_inv_freq(
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """The ``head_dim // 2`` inverse frequencies ``theta ** (-2i / head_dim)``, scaled if asked.

    Example::

        >>> rope_inv_freq(4, 10000.0)
        tensor([1.0000, 0.0100])
    """
    if head_dim % 2:
        raise ValueError(f"rotary_tables: head_dim must be even, found {head_dim}")
    if _on_meta(device):
        return torch.empty(head_dim // 2, dtype=torch.float32, device="meta")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / theta**exponents
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rotary_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(max_seq_len, head_dim // 2)`` for rotary embeddings.

    ``device`` None: the default device (``with torch.device(...)``). On the meta device
    the tables are empty meta tensors of that shape (nothing is computed).

    Example::

        >>> cos, sin = rotary_tables(8, 16, 10000.0)
        >>> cos.shape
        torch.Size([16, 4])
    """
    inv_freq = rope_inv_freq(head_dim, theta, device, scaling)
    if inv_freq.is_meta:
        # torch.empty, not empty_like: on meta, empty_like runs torch's Python references too
        shape = (max_seq_len, head_dim // 2)
        return (
            torch.empty(shape, dtype=torch.float32, device="meta"),
            torch.empty(shape, dtype=torch.float32, device="meta"),
        )
    positions = torch.arange(max_seq_len, dtype=torch.int64, device=inv_freq.device).float()
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim of ``x`` (``(..., seq, head_dim)``) by position.

    ``cos``/``sin`` are the tables' rows of each token's position, broadcastable to
    ``(..., seq, head_dim // 2)`` (e.g. ``(batch, 1, seq, head_dim // 2)``). The result
    keeps ``x``'s dtype: the float32 tables are cast to it first, as transformers' rotary
    embedding does, so bfloat16 queries (FSDP's mixed precision) stay bfloat16.

    Example::

        >>> cos, sin = rotary_tables(4, 3, 10000.0)
        >>> apply_rotary(torch.ones(1, 1, 3, 4), cos, sin).shape
        torch.Size([1, 1, 3, 4])
    """
    # chunk (not slicing) keeps the backward free of slice_backward, which has no DTensor rule.
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
