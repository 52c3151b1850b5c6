"""Pipeline parallelism for declarative models, run by ``torch.distributed.pipelining``.

A model's :class:`~hyper_parallel.dmodule.ModelSpec` declares where it can be cut
(:class:`PipelineSplit`); :func:`pipeline` builds this rank's stages (original FQNs,
parallelized over the mesh's other axes like the whole model), initialises them as one
device would, and runs them with one of torch's schedules. No scheduler of our own.

Example::

    from hyper_parallel.dmodule.pipeline import pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with torch.device("meta"):
        model = Llama.Config(n_layers=4).build()
    pipe = pipeline(model, mesh, schedule="1F1B", n_microbatches=4, loss_fn=cross_entropy)
    torch.manual_seed(0)
    pipe.init_weights()            # this rank's stage only, values as on one device
    loss = pipe.step(tokens, target=targets)
"""

from hyper_parallel.dmodule.pipeline.split import (
    PassThrough,
    PipelineSplit,
    StageLayers,
    StagePlan,
    build_stage,
    even_starts,
    plan_stages,
)
from hyper_parallel.dmodule.pipeline.stages import (
    SCHEDULES,
    Pipeline,
    microbatch_weights,
    pipeline,
    stage_owner,
)

__all__ = [
    "SCHEDULES",
    "PassThrough",
    "Pipeline",
    "PipelineSplit",
    "StageLayers",
    "StagePlan",
    "build_stage",
    "even_starts",
    "microbatch_weights",
    "pipeline",
    "plan_stages",
    "stage_owner",
]
