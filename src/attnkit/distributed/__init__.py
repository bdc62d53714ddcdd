"""Context parallelism: one attnkit attention call sharded over a torch.distributed group.

torch.distributed moves the tensors (gloo on CPU, NCCL on GPU); this package supplies the
math that makes the shards equal the whole: the log-sum-exp merge (softmax), the sum
merge (sigmoid), and state passing (linear attention). See docs/distributed.md.
"""

from .call import attention
from .layout import LAYOUTS, Layout, layout_for
from .shards import positions, shard, unshard

__all__ = ["LAYOUTS", "Layout", "attention", "layout_for", "positions", "shard", "unshard"]
