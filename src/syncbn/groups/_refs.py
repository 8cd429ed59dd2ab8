"""Naming process groups by their global ranks: :func:`group_ranks` and :class:`ProcessGroupRef`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from . import _own


def group_ranks(process_group: Any) -> list[int]:
    """Global ranks of the members of ``process_group`` (``None``: the default group)."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    wire = _own.wire_ranks(process_group)  # one of syncbn's own (not registered with torch)
    if wire is not None:
        return list(wire)
    return list(dist.get_process_group_ranks(process_group))


class ProcessGroupRef:
    """A picklable stand-in for a process group, naming it by its global ranks.

    Modules store one in place of an explicit process group when they are pickled (``torch.save``);
    :func:`resolve` finds the live group with the same ranks again at the loaded module's first call.

    Args:
        ranks: the global ranks of the group's members, in group-rank order.
    """

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)

    def lookup(self) -> Any:
        """The live process group with these ranks; ``RuntimeError`` when no such group exists."""
        if self.ranks == list(range(dist.get_world_size())):
            return None
        for group, mapping in dist.distributed_c10d._world.pg_group_ranks.items():
            if _own.owned(group):  # syncbn's own groups are never the user's
                continue
            if sorted(mapping, key=mapping.__getitem__) == self.ranks:
                return group
        raise RuntimeError(
            f"syncbn: this module was saved with a process group of global ranks {self.ranks}, "
            "and no such group exists in this job; create it with torch.distributed.new_group "
            "and assign it to module.process_group"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessGroupRef) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessGroupRef(ranks={self.ranks})"
