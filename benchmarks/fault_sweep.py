"""The fault-injection suite at length: every bit of one manifest flipped, many SIGKILLs at random
moments, many outage/reset schedules. Prints the figures the README quotes.

    .venv/bin/python benchmarks/fault_sweep.py [--kills 40] [--outages 20]

``--smoke``: 32 of the manifest's bits, one kill, one outage schedule (CI runs it).

Starts its own moto server (and a proxy in front of it for the outages). Nothing lost, nothing
wrong loaded, no temporary left after a restart: the last line says so, or the trials that failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common.tables import print_table  # noqa: E402
from tests.support.faults import GOLDEN, Tally, flip_trials, kill_trial, outage_trial  # noqa: E402
from tests.support.moto_server import CREDENTIALS, FaultyProxy, moto_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=40)
    parser.add_argument("--outages", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a few of each trial: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.kills, args.outages = 1, 1
    logging.getLogger("persist_core").setLevel(logging.CRITICAL)  # the trials fail uploads on purpose
    os.environ.update(CREDENTIALS)
    os.environ.update({"PERSIST_REMOTE_RETRIES": "2", "PERSIST_REMOTE_BACKOFF_MS": "10"})
    import s3fs

    rows: list[tuple[str, Tally, float]] = []
    with moto_server() as endpoint, tempfile.TemporaryDirectory() as work:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        options = {"client_kwargs": {"endpoint_url": endpoint}}

        t0 = time.perf_counter()
        nbits = (GOLDEN / "v2-manifest.json").stat().st_size * 8
        bits = list(range(0, nbits, max(1, nbits // 32) if args.smoke else 1))
        rows.append((f"manifest bit flips ({'every bit' if len(bits) == nbits else f'{len(bits)} bits'})",
                     flip_trials(Path(work) / "flips", bits), time.perf_counter() - t0))

        t0, kills = time.perf_counter(), Tally()
        for seed in range(args.kills):
            bucket = f"sweep-{uuid.uuid4().hex[:10]}"
            fs.mkdir(bucket)
            kills.add(kill_trial(Path(work) / f"kill-{seed}", f"s3://{bucket}/run", options, seed))
        rows.append(("SIGKILL at a random moment (save/commit/upload/prune)", kills, time.perf_counter() - t0))

        t0, outages = time.perf_counter(), Tally()
        proxy = FaultyProxy(int(endpoint.rsplit(":", 1)[1]))
        try:
            for seed in range(args.outages):
                bucket = f"sweep-{uuid.uuid4().hex[:10]}"
                fs.mkdir(bucket)
                outages.add(outage_trial(Path(work) / f"outage-{seed}", f"s3://{bucket}/run", proxy, seed))
        finally:
            proxy.close()
        rows.append(("remote outages and connection resets", outages, time.perf_counter() - t0))

    total = Tally()
    for _, tally, _ in rows:
        total.add(tally)
    print_table(["trial", "faults injected", "checkpoints lost", "wrong values loaded", "temporaries left", "time"],
                [[name, tally.faults, tally.lost, tally.wrong, tally.leaks, f"{secs:.1f} s"] for name, tally, secs in rows])
    for note in total.notes[:20]:
        print("  !", note)
    ok = total.lost == total.wrong == total.leaks == 0
    print(f"{'OK' if ok else 'FAILED'}: {total.faults} faults injected, {total.lost} checkpoints lost, "
          f"{total.wrong} wrong values loaded, {total.leaks} temporaries left")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
