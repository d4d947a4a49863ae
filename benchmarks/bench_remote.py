"""Upload/download benchmark against a local moto S3 server, side by side with raw clients.

In one run, on the same ~1 GiB checkpoint and the same moto server (127.0.0.1):

* the best raw client throughput: boto3 ``upload_file`` multipart over a small grid of part
  sizes and concurrencies (the baseline), and plain ``s3fs.put_file`` with its defaults;
* torch-persist: ``handle.stats.upload_gbps`` (shards + size checks + the store's checksums + manifest) and the
  fresh-machine ``load()`` (ranged parallel reads straight into the tensors, checksums verified; a
  local copy written alongside and committed after), against boto3 ``download_file`` at its best setting of a
  grid (part size x concurrency), found the same way as the upload's, in the same run, interleaved round by round.

The moto server is a Python process on this machine: loopback moto is bound by moto's own CPU (and reads the whole
object for every ranged GET), so the absolute rates say little about a real link; the ratios to boto3, on the same
server and bytes in the same run, are what counts.

Usage: ``python benchmarks/bench_remote.py [--gib 1.0] [--repeat 2] [--concurrency N]``; ``--smoke``: 8 MiB, one
boto3 setting, one round, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import MB  # noqa: E402
from persist_core import CheckpointEngine, KeepLastN  # noqa: E402
from tests.support.moto_server import CREDENTIALS, moto_server  # noqa: E402


def settings(engine: CheckpointEngine) -> str:
    """The engine's upload part size and concurrency, for the table's label: read from its remote tier, a private
    attribute (``engine._tier``), so a regrouped engine still runs the benchmark, the label then says so."""
    tier = getattr(engine, "_tier", None)
    part, concurrency = getattr(tier, "part_bytes", None), getattr(tier, "concurrency", None)
    if part is None or concurrency is None:
        return "part size and concurrency not found"
    return f"part {part // MB} MB, concurrency {concurrency}"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="the engine's remote_concurrency (default: its own, PERSIST_REMOTE_CONCURRENCY or 8)")
    parser.add_argument("--smoke", action="store_true", help="8 MiB, one setting, one round: a check that it runs")
    args = parser.parse_args(argv)
    grid = [(16, 4)] if args.smoke else [(p, c) for p in (16, 64) for c in (4, 8, 16)]
    if args.smoke:
        args.gib, args.repeat = 8 / 1024, 1
    logging.basicConfig(level=logging.WARNING)
    os.environ.update(CREDENTIALS)
    import boto3
    import s3fs
    from boto3.s3.transfer import TransferConfig

    n = int(args.gib * (1 << 30)) // 4
    state = {f"w{i}": torch.randn(n // 8) for i in range(8)}
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    lines = []
    try:
        with moto_server() as endpoint:
            s3 = boto3.client("s3", endpoint_url=endpoint)
            s3.create_bucket(Bucket="bench")
            options = {"client_kwargs": {"endpoint_url": endpoint}}
            engine = CheckpointEngine(work / "nvme", remote_url="s3://bench/persist", storage_options=options,
                                      keep_local=KeepLastN(1), keep_remote=KeepLastN(1),
                                      remote_concurrency=args.concurrency)
            engine.save(state, step=0).wait()  # warm-up; also gives the shard file the raw clients upload
            (saved,) = Path(engine.list()[-1].path).glob("*.safetensors")
            shard = work / "shard.safetensors"  # the raw clients' copy; retention will remove step 0
            shutil.copyfile(saved, shard)
            size = shard.stat().st_size

            def gbps(seconds: list[float]) -> float:
                return size / statistics.median(seconds) / 1e9

            raw = {}  # a quick grid to find boto3's best settings for this server
            for part_mb, conc in grid:
                cfg = TransferConfig(multipart_threshold=part_mb * MB, multipart_chunksize=part_mb * MB,
                                     max_concurrency=conc)
                raw[(part_mb, conc)] = gbps([timed(lambda: s3.upload_file(str(shard), "bench", "raw/shard", Config=cfg))])
            best_part, best_conc = max(raw, key=raw.get)
            best_cfg = TransferConfig(multipart_threshold=best_part * MB, multipart_chunksize=best_part * MB,
                                      max_concurrency=best_conc)
            fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
            # then interleaved rounds (the server slows as it fills): best boto3, plain s3fs, torch-persist
            boto_t, s3fs_t, ours_t = [], [], []
            for step in range(1, args.repeat + 1):
                # every contender writes a new key each round and drops the previous one, as retention does
                boto_t.append(timed(lambda: s3.upload_file(str(shard), "bench", f"raw/boto3-{step}", Config=best_cfg)))
                s3fs_t.append(timed(lambda: fs.put_file(str(shard), f"bench/raw/s3fs-{step}")))
                for old in (f"raw/boto3-{step - 1}", f"raw/s3fs-{step - 1}"):
                    s3.delete_object(Bucket="bench", Key=old)
                handle = engine.save(state, step=step)
                handle.wait()
                ours_t.append(handle.stats.upload_s)
            best, plain_s3fs, ours = gbps(boto_t), gbps(s3fs_t), gbps(ours_t)
            engine.close()

            def download(cfg: TransferConfig) -> float:
                return timed(lambda: s3.download_file("bench", "raw/shard", str(work / "dl.bin"), Config=cfg))

            def config(part_mb: int, conc: int) -> TransferConfig:
                return TransferConfig(multipart_threshold=part_mb * MB, multipart_chunksize=part_mb * MB,
                                      max_concurrency=conc)

            raw_down = {setting: gbps([download(config(*setting))]) for setting in grid}  # boto3's best download
            best_down = max(raw_down, key=raw_down.get)
            boto_down, downs, copied = [], [], []
            for i in range(args.repeat):  # interleaved: boto3's best, then a fresh machine's load(), each round
                boto_down.append(download(config(*best_down)))
                fresh = CheckpointEngine(work / f"fresh{i}", remote_url="s3://bench/persist", storage_options=options,
                                         remote_concurrency=args.concurrency)
                t0 = time.perf_counter()
                fresh.load()
                downs.append(time.perf_counter() - t0)
                fresh.reader.wait_copies()  # the local copy written alongside, committed after the load returned
                copied.append(time.perf_counter() - t0)
                fresh.close()
                shutil.rmtree(work / f"fresh{i}")
            down_raw = gbps(boto_down)
            down_ours, copy_ours = gbps(downs), gbps(copied)

            lines += [
                f"{time.strftime('%Y-%m-%d')}, checkpoint: {size / 1e9:.2f} GB, moto server on 127.0.0.1, "
                f"{len(os.sched_getaffinity(0))} cores (shared with the server); boto3 grid of part size x concurrency, "
                f"one run each: upload " + ", ".join(f"{p}MB/{c}: {v:.3f}" for (p, c), v in raw.items()) + " GB/s; "
                "download " + ", ".join(f"{p}MB/{c}: {v:.3f}" for (p, c), v in raw_down.items()) + " GB/s",
                f"then {args.repeat} interleaved rounds (median):",
                "",
                "| upload | GB/s | / best boto3 |",
                "|---|---:|---:|",
                f"| boto3 upload_file, best of the grid (part {best_part} MB, concurrency {best_conc}) | {best:.3f} | 1.00x |",
                f"| s3fs put_file (defaults) | {plain_s3fs:.3f} | {plain_s3fs / best:.2f}x |",
                f"| **torch-persist upload** ({settings(engine)}) | {ours:.3f} | {ours / best:.2f}x |",
                "",
                "| download | GB/s | / boto3 |",
                "|---|---:|---:|",
                f"| boto3 download_file, best of the grid (part {best_down[0]} MB, concurrency {best_down[1]}) "
                f"| {down_raw:.3f} | 1.00x |",
                f"| **torch-persist load() on a fresh machine** (ranged reads straight into the tensors + verify) | {down_ours:.3f} | {down_ours / down_raw:.2f}x |",
                f"| ... until its local copy is committed too (fsync, manifest, rename; after load() returned) | {copy_ours:.3f} | {copy_ours / down_raw:.2f}x |",
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
