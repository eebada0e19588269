"""Stage 3 hierarchical partitioning (ZeroConfig.node_size): which ranks form a node,
and the node process groups the engine's backward gathers run on
(Note [Hierarchical partitioning] in csrc/engine/secondary.h)."""
from __future__ import annotations

import os

import torch.distributed as dist


def resolve_node_size(node_size, world: int) -> int | None:
    """The node size for `world` ranks, or None without a hierarchy (off, one process, one node)."""
    if node_size is None or world == 1:
        return None
    if node_size == "auto":
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None or not env.isdigit() or int(env) < 1:
            raise ValueError(f"zero_ext: node_size='auto' reads LOCAL_WORLD_SIZE (set by torchrun), which is "
                             f"{env!r} here; launch with torchrun or pass node_size=<ranks per node>")
        node_size = int(env)
    if world % node_size != 0:
        raise ValueError(f"zero_ext: node_size={node_size} does not divide the world size {world}; use a "
                         f"node_size that divides it (the ranks per node), or node_size=None")
    return None if node_size == world else node_size


def node_group(pg, node_size: int):
    """This rank's node group: ranks [g*L, (g+1)*L) of pg, in pg's backend."""
    ranks = dist.get_process_group_ranks(pg)
    backend = dist.get_backend(pg)
    nodes = [ranks[g:g + node_size] for g in range(0, len(ranks), node_size)]
    if len(ranks) == dist.get_world_size():
        return dist.new_subgroups_by_enumeration(nodes, backend=backend)[0]
    return dist.new_group(nodes[pg.rank() // node_size], backend=backend, use_local_synchronization=True)
