"""Demo of hp-config: declare nested configs next to the classes they build, then use them.

Run it (stdlib only, no torch needed)::

    uv run --frozen python scripts/demo_config.py

It declares a small model as nested ``Config`` dataclasses, changes it with dotted
overrides (as a command line would), round-trips it through a plain dict (as a JSON or
YAML file would), and builds the object tree from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hyper_parallel.config import Configurable


class Linear(Configurable):
    """A stand-in layer: remembers its sizes."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """Sizes of one linear layer."""

        in_features: int = 16
        out_features: int = 16
        bias: bool = True

    def __init__(self, *, config: Config) -> None:
        self.config = config

    def __repr__(self) -> str:
        c = self.config
        return f"Linear({c.in_features} -> {c.out_features}, bias={c.bias})"


def _two_layers() -> list[Linear.Config]:
    return [Linear.Config(), Linear.Config()]


class Mlp(Configurable):
    """A stack of Linear layers built from one nested config."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """The stack's name and its layers' configs."""

        name: str = "mlp"
        layers: list[Linear.Config] = field(default_factory=_two_layers)

    def __init__(self, *, config: Config) -> None:
        self.name = config.name
        self.layers: list[Linear] = [layer.build() for layer in config.layers]


def main() -> None:
    """Declare, override, serialize, rebuild and build a nested config; print each step."""
    config = Mlp.Config()
    print("default config:  ", json.dumps(config.to_dict()))

    # Dotted overrides address nested fields and list items; the original stays unchanged.
    tuned = config.apply_overrides(
        ["name=wide", "layers.0.out_features=64", "layers.1.in_features=64", "layers.1.bias=false"]
    )
    print("after overrides: ", json.dumps(tuned.to_dict()))
    assert config.layers[0].out_features == 16, "apply_overrides must return a new config"

    # to_dict() gives plain JSON-able data; from_dict() restores an equal typed config.
    restored = Mlp.Config.from_dict(json.loads(json.dumps(tuned.to_dict())))
    assert restored == tuned, f"round trip changed the config: {restored} != {tuned}"
    print("round trip:       to_dict -> JSON -> from_dict gives an equal config")

    model = restored.build()
    assert isinstance(model, Mlp)
    print(f"built:            Mlp(name={model.name!r}, layers={model.layers})")


if __name__ == "__main__":
    main()
