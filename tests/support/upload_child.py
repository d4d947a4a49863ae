"""Child for the SIGKILL-during-upload test: commit locally, say so, then upload (and be killed)."""

from __future__ import annotations

import sys

from persist_core import CheckpointEngine
from tests.integration.test_s3 import state_for


def main() -> None:
    local_dir, url, endpoint = sys.argv[1:4]
    engine = CheckpointEngine(local_dir, remote_url=url, storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    handle = engine.save(state_for(1, n=1536), step=1)
    handle.wait_local()
    print("committed locally", flush=True)
    handle.wait_remote()


if __name__ == "__main__":
    main()
