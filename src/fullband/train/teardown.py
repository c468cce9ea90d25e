"""Setting up and tearing down torch.distributed so that no collective's worker thread outlives Python: one that
frees a finished collective while the interpreter finalizes aborts the process (SIGABRT). ``destroy_process_group``
prevents it only if no reference keeps the group alive: ``torch.distributed.nn``'s ``group=group.WORLD`` default
arguments and the device meshes FSDP2's DTensors cache."""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist


def prepare_process_group() -> None:
    """Call before ``init_process_group``: imports ``torch.distributed.nn`` while no world group exists,
    so that its default arguments hold None rather than the group."""
    import torch.distributed.nn  # noqa: F401


def destroy_process_groups() -> None:
    """Release torch's cached references to device meshes, collect reference cycles, then destroy every process
    group, so that each group's destructor joins its worker threads now."""
    _clear_dtensor_caches()
    gc.collect()
    _release_mesh_groups()
    dist.destroy_process_group()
    gc.collect()


def _release_mesh_groups() -> None:
    """Empty the group registry of every device mesh still alive: a mesh outlives the run when torch keeps it
    (2.11), and would keep its groups, and their worker threads, with it."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return  # no mesh was ever made
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def _clear_dtensor_caches() -> None:
    """Empty the DTensor caches that keep device meshes (and so process groups) alive. These are torch
    internals: each is looked up defensively, so a torch version without one of them simply skips it."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever created
    from torch.distributed.tensor import DTensor, debug

    clears = [getattr(debug, "_clear_sharding_prop_cache", None)]
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clears.append(getattr(getattr(propagator, "_propagate_tensor_meta_cached", None), "cache_clear", None))
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    clears.append(getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None))
    clears.append(getattr(redistribute, "clear_redistribute_planner_cache", None))
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    topo = getattr(collective_utils, "MeshTopoInfo", None)
    clears.append(getattr(getattr(topo, "build_from_mesh", None), "cache_clear", None))
    for clear in clears:
        if clear is not None:
            clear()
