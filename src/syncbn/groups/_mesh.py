"""A ``DeviceMesh`` as the group a layer synchronises over: a 1-D mesh's own group, a
multi-dimensional one's ranks flattened safely on every rank. See docs/internals/groups.md#devicemesh."""

from __future__ import annotations

import sys
import weakref
from typing import Any

from . import _meet, _subgroup

__all__ = ["is_mesh", "group_of", "mesh_argument"]

# id(mesh) -> (a weak reference to it, the process group it stands for).
_by_mesh: dict[int, tuple[weakref.ref[Any], Any]] = {}
# partition -> (a weak reference to the default group it was made under, this rank's group of it).
_made: dict[tuple[tuple[int, ...], ...], tuple[weakref.ref[Any], Any]] = {}
_mesh_types: set[type] = set()  # classes whose instances were found to be DeviceMesh objects


def is_mesh(value: Any) -> bool:
    """Whether ``value`` is a ``DeviceMesh`` (without importing ``torch.distributed.device_mesh``)."""
    if type(value) in _mesh_types:  # a set lookup: DeviceMesh's isinstance costs microseconds
        return True
    module = sys.modules.get("torch.distributed.device_mesh")
    cls = getattr(module, "DeviceMesh", None)
    if cls is not None and isinstance(value, cls):
        _mesh_types.add(type(value))
        return True
    return False


def group_of(mesh: Any) -> Any:
    """The process group ``mesh`` stands for; the first call with a multi-dimensional mesh object
    is collective over every rank of the job, which raise alike (before any group is made) when
    the meshes do not partition the job (``ValueError``) or a rank is missing (``CollectiveError``)."""
    hit = _by_mesh.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    group = mesh.get_group() if mesh.ndim == 1 else _flattened(mesh)
    for key in [k for k, (ref, _) in _by_mesh.items() if ref() is None]:
        del _by_mesh[key]
    _by_mesh[id(mesh)] = (weakref.ref(mesh), group)
    return group


def _flattened(mesh: Any) -> Any:
    """The group of all ranks of a multi-dimensional ``mesh`` (collective)."""
    mine = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    names = mesh.mesh_dim_names
    caller = f"syncbn: synchronising over the DeviceMesh{mesh.mesh.tolist()}" + (
        f" with dimensions {tuple(names)}" if names else ""
    )
    everyone: list[list[int]] = _meet.gather(caller, "mesh", mine)
    key = tuple(tuple(members) for members in _partition(everyone, caller))
    hit = _subgroup.cached(_made, key)
    return hit if hit is not None else _subgroup.make_sets(_made, key, key)


def _partition(everyone: list[list[int]], caller: str) -> list[list[int]]:
    """The distinct member sets, by first member; raises alike on every rank unless they partition the job."""
    listed = ", ".join(f"rank {r}: {members}" for r, members in enumerate(everyone))
    for rank, members in enumerate(everyone):
        if rank not in members or any(everyone[other] != members for other in members):
            raise ValueError(
                f"{caller}: expected every rank of the job to pass a DeviceMesh that holds it, the "
                "ranks of one group naming the same members (the same mesh, sliced alike, on every "
                f"rank; got {listed}). {_meet.NO_GROUP}"
            )
    return sorted({tuple(members): list(members) for members in everyone}.values())


def mesh_argument(device_mesh: Any, process_group: Any, group_size: Any, caller: str) -> Any:
    """``device_mesh`` checked for use as a layer's ``process_group`` (not with either of the others)."""
    if not is_mesh(device_mesh):
        raise TypeError(
            f"{caller}: expected device_mesh to be a torch.distributed.device_mesh.DeviceMesh "
            f"(got {type(device_mesh).__name__}: {device_mesh!r})"
        )
    if process_group is not None or group_size is not None:
        given = {"process_group": process_group, "group_size": group_size}
        shown = ", ".join(f"{name}={value!r}" for name, value in given.items() if value is not None)
        raise ValueError(
            f"{caller}: expected one of device_mesh, process_group and group_size "
            f"(got device_mesh and {shown})"
        )
    return device_mesh
