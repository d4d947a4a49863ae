"""The ``persist`` command: see, verify, move and prune checkpoints on any tier.

A LOCATION is a local directory (a ``local_dir``) or any fsspec URL (``s3://bucket/run-7``);
``--storage-options`` takes fsspec options as JSON (or set the variables s3fs reads, e.g.
``AWS_ENDPOINT_URL``). Exit codes: 0 ok, 1 verification failed, 2 usage or other error (one
line; ``--debug`` shows the traceback).
"""

from persist_core.cli.app import main
from persist_core.cli import browse, check, move, prune  # each registers its commands on main

__all__ = ["main", "browse", "check", "move", "prune"]
