"""Reference models built from the TP-ready layers.

Example::

    from hyper_parallel.dmodule.models.llama import Llama
    model = Llama.Config(dim=128).build()
"""
