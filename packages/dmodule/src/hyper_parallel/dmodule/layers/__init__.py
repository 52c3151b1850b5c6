"""TP-ready layers: Linear (column/row parallel), vocab-parallel Embedding, norms, attention, MLP, MoE.

Every layer is a :class:`~hyper_parallel.dmodule.Module` whose Config declares its
tensor-parallel layout over the ``tp`` mesh axis.

Example::

    from hyper_parallel.dmodule.layers import Linear
    layer = Linear.Config.colwise(64, 256).build()
    layer.parallelize(tp_mesh)
    layer.init_states()
"""

from hyper_parallel.dmodule.layers._common import block_sharding
from hyper_parallel.dmodule.layers.attention import Attention
from hyper_parallel.dmodule.layers.block import TransformerBlock
from hyper_parallel.dmodule.layers.embedding import Embedding
from hyper_parallel.dmodule.layers.feed_forward import FeedForward
from hyper_parallel.dmodule.layers.linear import Linear
from hyper_parallel.dmodule.layers.loss import cross_entropy
from hyper_parallel.dmodule.layers.moe import (
    GroupedExperts,
    MoE,
    TokenChoiceTopKRouter,
    expert_sharding,
    moe_aux_loss,
    update_load_balance,
)
from hyper_parallel.dmodule.layers.norm import LayerNorm, RMSNorm
from hyper_parallel.dmodule.layers.rope import (
    RopeScaling,
    apply_rotary,
    rope_inv_freq,
    rotary_tables,
)

__all__ = [
    "Attention",
    "Embedding",
    "FeedForward",
    "GroupedExperts",
    "LayerNorm",
    "Linear",
    "MoE",
    "RMSNorm",
    "RopeScaling",
    "TokenChoiceTopKRouter",
    "TransformerBlock",
    "apply_rotary",
    "block_sharding",
    "cross_entropy",
    "expert_sharding",
    "moe_aux_loss",
    "rope_inv_freq",
    "rotary_tables",
    "update_load_balance",
]
