"""Child for the fault trials: saves ``state_for(step)`` every step with a remote and retention on both
tiers until it is killed; prints ``committed <step>`` once each step's local commit is done.

argv: LOCAL_DIR REMOTE_URL FIRST_STEP (storage options as JSON in ``PERSIST_TEST_STORAGE_OPTIONS``).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading

from persist_core import CheckpointEngine, KeepLastN
from tests.support.faults import state_for


def main() -> None:
    local_dir, url, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = json.loads(os.environ.get("PERSIST_TEST_STORAGE_OPTIONS") or "null")
    engine = CheckpointEngine(local_dir, remote_url=url, storage_options=options, keep_local=KeepLastN(2),
                              keep_remote=KeepLastN(3), chunk_bytes=1 << 20)
    handles: queue.Queue = queue.Queue()

    def report() -> None:
        while True:
            handle = handles.get()
            handle.wait_local()
            print(f"committed {handle.step}", flush=True)

    threading.Thread(target=report, daemon=True).start()
    step = first
    while True:
        handles.put(engine.save(state_for(step), step=step))
        step += 1


if __name__ == "__main__":
    main()
