"""Map a dotted module name to the file of a package that holds it (import-graph tests)."""

from __future__ import annotations

from pathlib import Path


def module_file(package_dir: Path, package_name: str, module: str) -> str | None:
    """The file, relative to ``package_dir``, of ``module``; ``None``: not in the package.

    Example::

        >>> import hyper_parallel.dtensor as dt
        >>> module_file(Path(dt.__file__).parent, "hyper_parallel.dtensor", "hyper_parallel.dtensor")
        '__init__.py'
    """
    if module != package_name and not module.startswith(package_name + "."):
        return None
    parts = module[len(package_name) :].lstrip(".").split(".") if module != package_name else []
    base = package_dir.joinpath(*parts)
    if base.is_dir():
        return (base / "__init__.py").relative_to(package_dir).as_posix()
    candidate = base.with_suffix(".py")
    return candidate.relative_to(package_dir).as_posix() if candidate.exists() else None
