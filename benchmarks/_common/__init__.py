"""What the benchmarks share: the floors every checkpoint is compared against (``floors``), the models they train
and the chores around a state (``models``), the one table printer (``tables``: every result table is printed by
it, as markdown), re-exported here; and, imported from their modules (they import the engine): the ways to
checkpoint a loop, ours and the peers' (``savers``), a job that resumes and saves until it is killed (``jobs``),
the one kill-trial driver that kills it, restarts it and counts the steps each kill lost (``kills``), and the one
interleaved-blocks loop (``blocks``: training steps in blocks, each kind of saving or writing beside them).

Each benchmark puts the repository root on ``sys.path`` and imports from ``benchmarks._common``. Everything here
uses ``persist_core``'s public names only.
"""

from benchmarks._common.floors import (
    CHUNK,
    MB,
    THREADS,
    RawWrites,
    copy_floor,
    disk_gbps,
    disk_seconds,
    drop_cached,
    files_under,
    floor_copy,
    fsync_tree,
    open_for_writes,
    write_pass,
)
from benchmarks._common.tables import print_table, table
from benchmarks._common.models import (
    accel_model,
    alternate,
    cpu_model,
    differences,
    leaves,
    median,
    nbytes,
    tensors,
    training_state,
    tree_map,
)

__all__ = [
    "CHUNK",
    "MB",
    "THREADS",
    "RawWrites",
    "accel_model",
    "alternate",
    "copy_floor",
    "cpu_model",
    "differences",
    "disk_gbps",
    "disk_seconds",
    "drop_cached",
    "files_under",
    "floor_copy",
    "fsync_tree",
    "leaves",
    "median",
    "nbytes",
    "open_for_writes",
    "print_table",
    "table",
    "tensors",
    "training_state",
    "tree_map",
    "write_pass",
]
