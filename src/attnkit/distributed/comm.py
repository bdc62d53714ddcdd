"""The few torch.distributed operations attnkit needs, with errors that say what failed.

torch.distributed is the engine (gloo on CPU, NCCL on GPU); this file only names ranks
inside a group and turns a failure of the group (a peer that crashed, or the group's
timeout, set by ``init_process_group(timeout=...)``) into an error that says which
exchange was waiting.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass(frozen=True)
class Group:
    """A process group with this process's rank and the size, in group coordinates."""

    handle: dist.ProcessGroup | None
    rank: int
    world: int

    def global_rank(self, r: int) -> int:
        if self.handle is None or self.handle is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.handle, r)


def resolve_group(group) -> Group:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "group: torch.distributed is not initialised; call torch.distributed.init_process_group "
            "(gloo on CPU, nccl on GPU) before attnkit.distributed, or use attnkit.attention in one process"
        )
    handle = dist.group.WORLD if group is None else group
    return Group(handle, dist.get_rank(handle), dist.get_world_size(handle))


class GroupError(RuntimeError):
    """The group failed during an exchange: a peer crashed, did not make the same call, or
    the group timed out. Nothing more can be exchanged for this call."""


@contextmanager
def exchange(what: str, g: Group):
    """Re-raise a communication failure with the step that was waiting and the way out."""
    try:
        yield
    except GroupError:
        raise
    except (RuntimeError, dist.DistBackendError) as err:  # gloo/nccl raise these on timeout or a dead peer
        raise GroupError(
            f"attnkit.distributed: rank {g.rank} of {g.world} failed during {what}: another rank crashed, "
            f"did not make the same call, or the group timed out ({type(err).__name__}: {err})"
        ) from err


def all_gather_ints(values: list[int], g: Group, what: str) -> list[list[int]]:
    """Every rank's list of ints (same length on every rank)."""
    mine = torch.tensor(values, dtype=torch.long)
    out = [torch.empty_like(mine) for _ in range(g.world)]
    with exchange(what, g):
        dist.all_gather(out, mine, group=g.handle)
    return [t.tolist() for t in out]


def agree(error: Exception | None, values: list[int], g: Group, what: str) -> list[list[int]]:
    """Every rank's ``values``, once every rank has said whether its own input is valid.

    When any rank passes an ``error``, every rank raises the same ValueError (the failing
    ranks' messages, each naming its argument, and which ranks failed), so no rank goes
    on into an exchange the others will never join. The messages cross the group only
    then: a valid call costs one all-gather of a few ints.
    """
    table = all_gather_ints([int(error is None), *values], g, what)
    failed = [r for r, row in enumerate(table) if not row[0]]
    if failed:
        messages = [None] * g.world
        with exchange(what, g):
            dist.all_gather_object(messages, None if error is None else str(error), group=g.handle)
        raise ValueError(_failure_text(failed, messages, g.world)) from error
    return [row[1:] for row in table]


def _failure_text(failed: list[int], messages: list, world: int) -> str:
    distinct = list(dict.fromkeys(messages[r] for r in failed))
    if len(distinct) == 1:
        return f"{distinct[0]} (on rank(s) {failed} of {world}; every rank raises this error)"
    parts = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
    return f"ranks {failed} of {world} refused the call (every rank raises this error): {parts}"


class Pending:
    """Posted sends and receives; ``wait()`` finishes them (once)."""

    def __init__(self, works, g: Group, what: str, ops=()):
        # the ops keep the tensors (contiguous copies included) alive until the wait
        self.works, self.g, self.what, self.ops = works, g, what, list(ops)

    def wait(self) -> None:
        with exchange(self.what, self.g):
            for w in self.works:
                w.wait()
        self.works, self.ops = [], []


def post(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], g: Group, what: str) -> Pending:
    """Post point-to-point sends and receives (peer ranks in group coordinates) at once
    with ``batch_isend_irecv``; compute can run until ``wait()``."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), g.global_rank(p), g.handle) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, g.global_rank(p), g.handle) for t, p in recvs]
    if not ops:
        return Pending([], g, what)
    with exchange(what, g):
        works = dist.batch_isend_irecv(ops)
    return Pending(works, g, what, ops)
