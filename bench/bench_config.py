"""Time build(), to_dict() and from_dict() on a 1,000-node config tree (medians of repeats).

Run: uv run python bench/bench_config.py
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.config import Configurable

REPEATS = 9
LAYERS = 333  # 1 root + 333 * (block, attention, mlp) = 1,000 config nodes


class Attention(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        heads: int = 8
        head_dim: int = 64
        dropout: float = 0.0
        rope: tuple[float, ...] = (1.0, 10000.0)


class Mlp(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        hidden: int = 2048
        activation: Callable[..., Any] = math.tanh
        param_init: dict[str, Callable[..., Any]] = field(
            default_factory=lambda: {"weight": math.erf, "bias": math.erfc}
        )


class Block(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        dim: int = 512
        attention: Attention.Config = field(default_factory=Attention.Config)
        mlp: Mlp.Config = field(default_factory=Mlp.Config)
        tags: list[str] = field(default_factory=lambda: ["a", "b"])


class Model(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        layers: list[Block.Config] = field(default_factory=list)
        name: str = "bench"

    def __init__(self, *, config: Model.Config) -> None:
        self.config = config


def _median_ms(action: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    """Print one table row per operation."""
    config = Model.Config(layers=[Block.Config() for _ in range(LAYERS)])
    nodes = sum(1 for _ in config.traverse())
    data = config.to_dict()
    assert Model.Config.from_dict(data) == config
    rows = [
        ("build()", _median_ms(config.build)),
        ("to_dict()", _median_ms(config.to_dict)),
        ("from_dict()", _median_ms(lambda: Model.Config.from_dict(data))),
        ("apply_overrides(1)", _median_ms(lambda: config.apply_overrides(["layers.7.dim=64"]))),
    ]
    print(
        f"hp-config, {nodes} config nodes, {len(json.dumps(data))} bytes of JSON, median of {REPEATS}"
    )
    print(f"{'operation':<20} {'ms':>8} {'us/node':>8}")
    for name, ms in rows:
        print(f"{name:<20} {ms:>8.2f} {ms * 1e3 / nodes:>8.2f}")


if __name__ == "__main__":
    main()
