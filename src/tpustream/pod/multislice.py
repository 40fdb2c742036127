"""Several TPU slices as one job over the data-center network (megascale): what every host is told.

The TPU runtime of each host joins the others when its environment names the
slice count, its own slice and the coordinator, the first host of slice 0
(MEGASCALE_*; Ray's TPU support, ray.util.tpu.get_tpu_coordinator_env_vars,
sets the same four, port 8081). Both launchers set them: ``gke-manifest
--num-slices N`` as one Job per slice, the TPU VM launcher ``--num-slices N`` as
one queued resource of N nodes, NAME-0 .. NAME-(N-1) (the queued-resource API's
names for a request with a node count and NAME as the node prefix).
"""

from __future__ import annotations

MEGASCALE_PORT = 8081


def node_names(name: str, slices: int) -> tuple[str, ...]:
    """The TPU VM nodes of a pod named ``name``: itself when one slice, else NAME-0 .. NAME-(slices-1)."""
    return (name,) if slices == 1 else tuple(f"{name}-{index}" for index in range(slices))


def megascale_env(slices: int, slice_id: int, coordinator: str) -> tuple[tuple[str, str], ...]:
    """What one host of slice ``slice_id`` needs (nothing when one slice); ``coordinator``: a name or IP."""
    if slices == 1:
        return ()
    return (
        ("MEGASCALE_NUM_SLICES", str(slices)),
        ("MEGASCALE_SLICE_ID", str(slice_id)),
        ("MEGASCALE_COORDINATOR_ADDRESS", f"{coordinator}:{MEGASCALE_PORT}"),
        ("MEGASCALE_PORT", str(MEGASCALE_PORT)),
    )
