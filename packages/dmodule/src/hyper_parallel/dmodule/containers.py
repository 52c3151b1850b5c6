"""ModuleList, ModuleDict and Sequential as :class:`Module` subclasses (defined in ``module``).

Example::

    >>> from hyper_parallel.dmodule.containers import ModuleList
    >>> layers = ModuleList([])
    >>> layers.init_states()
"""

from hyper_parallel.dmodule.module import ModuleDict, ModuleList, Sequential

__all__ = ["ModuleDict", "ModuleList", "Sequential"]
