"""What the remote codec (issue 56) costs and saves, on a trained-like state, in one run.

The state: a stack of linear layers whose fp32 master weights start N(0, 0.02), trained ``--steps`` (>= 20) seeded
AdamW steps on random regression data; saved as bf16 weights and fp32 AdamW moments (``exp_avg``,
``exp_avg_sq``), as a mixed-precision run keeps them. Measured:

* stored bytes with and without ``remote_compression="zstd"`` (the bar: <= 0.85x), and per dtype group;
* compression and decompression rate per core (one thread, every block of every file, byte planes included);
* upload (the save handle's ``upload_s``: shards, records and manifest) and fresh-machine restore (a new
  ``local_dir``, ``load()``) wall time against the same engine without a codec, on the moto server as it is
  (loopback; bound by moto's own CPU) and through a throttled link (a token bucket of ``--link-mbps`` MB/s shared by
  every request the tier's S3 client makes, uploads and ranged reads alike: the time a request takes is the longer
  of moto's and the link's), in ``--repeat`` interleaved rounds (medians, and their range);
* the same with ``remote_encryption_key`` on (AES-256-GCM) and with both.

Every restore is compared bit-exact with the state saved. Usage: ``python benchmarks/bench_codec.py [--mib 256]
[--link-mbps 100 500] [--steps 20] [--repeat 3]``; ``--smoke``: a 16 MiB state, one link, seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import botocore.client
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persist_core import CheckpointEngine  # noqa: E402
from persist_core.format.manifest import Manifest  # noqa: E402
from persist_core.tiers.codec import Codec, SecretKey, block_aad  # noqa: E402
from persist_core.tiers.codec import files as codec_files  # noqa: E402
from persist_core.tiers._s3 import S3Transfer  # noqa: E402
from tests.support.moto_server import CREDENTIALS, moto_server  # noqa: E402
from tests.support.states import assert_state_equal  # noqa: E402

MB = 1e6
KEY = os.urandom(32)


def trained_state(mib: float, steps: int) -> dict:
    """bf16 weights and fp32 AdamW moments after ``steps`` seeded steps (about ``mib`` MiB saved)."""
    torch.manual_seed(0)
    width = 1024
    # per parameter element: 2 bytes (bf16) + 8 bytes (two fp32 moments)
    layers = max(1, int(mib * (1 << 20) / (width * width * 10)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, width)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    moments = {str(i): {"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone()}
               for i, s in enumerate(opt.state.values())}
    return {"model": weights, "optim": moments, "step": steps}


class Link:
    """A bottleneck of ``rate`` bytes/s shared by every request: each transfer ends no sooner than the link
    would have carried its bytes after the ones before it."""

    def __init__(self, rate: float) -> None:
        self.rate, self._free_at, self._lock = rate, 0.0, threading.Lock()

    def carry(self, nbytes: int, fn):
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + nbytes / self.rate
            done_at = self._free_at
        out = fn()
        left = done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out


def throttle(link: Link | None) -> None:
    """Route every request the remote tier's S3 client sends or reads through ``link`` (``None``: as they are), one
    request at a time as the store sees them: each PUT and each part of a multipart upload (s3transfer's parts without
    a codec, the streamed parts with one: the same granularity, so the completion of a multipart upload is not hidden
    under one side's link time) and each ranged read (into the tensors without a codec, decoded with one)."""
    botocore.client.BaseClient._make_api_call = _REAL_CALL if link is None else _carried_call(link)
    for name, real in _REAL_READS.items():
        setattr(S3Transfer, name, real if link is None else _carried(link, real, _READ_SIZES[name]))


def _carried(link: Link, real, size):
    return lambda self, *args, **kwargs: link.carry(size(*args), lambda: real(self, *args, **kwargs))


def _carried_call(link: Link):
    def call(self, operation, params):
        if operation not in ("PutObject", "UploadPart"):
            return _REAL_CALL(self, operation, params)
        return link.carry(len(params.get("Body") or b""), lambda: _REAL_CALL(self, operation, params))

    return call


_READ_SIZES = {"read_range": lambda path, start, end: end - start,
               "read_into": lambda path, start, views: sum(v.nbytes for v in views)}
_REAL_READS = {name: S3Transfer.__dict__[name] for name in _READ_SIZES}
_REAL_CALL = botocore.client.BaseClient._make_api_call


def rates(ckpt: Path, codec: Codec) -> tuple[int, float, float]:
    """``(stored bytes, compression MB/s, decompression MB/s)`` of every file of ``ckpt``, on one thread."""
    manifest = Manifest.from_bytes((ckpt / "manifest.json").read_bytes(), where=str(ckpt))
    stored = raw = 0
    enc_s = dec_s = 0.0
    codec.decode(codec.encode(b"warm" * 4096, 2, b""), b"", encrypted=codec.key is not None, size=16384, where="")
    for f in manifest.files:
        data = (ckpt / f.name).read_bytes()
        head = data[: 1 << 20]
        from persist_core.tiers.codec import planes
        widths = planes.block_widths(head, file_size=f.size, block_bytes=f.chunk_bytes)
        for i in range(len(f.chunks)):
            block = data[i * f.chunk_bytes : (i + 1) * f.chunk_bytes]
            aad = block_aad("r", "s", f.name, i)
            t0 = time.perf_counter()
            out = codec.encode(block, widths[i], aad)
            t1 = time.perf_counter()
            back = codec.decode(out, aad, encrypted=codec.key is not None, size=len(block), where="bench")
            t2 = time.perf_counter()
            assert back == block
            stored, raw, enc_s, dec_s = stored + len(out), raw + len(block), enc_s + t1 - t0, dec_s + t2 - t1
    return stored, raw / MB / enc_s, raw / MB / dec_s


def round_trip(base: Path, url: str, state: dict, options: dict, s3: dict) -> tuple[float, float]:
    """``(upload s, fresh-machine restore s)`` of ``state`` through ``url`` with ``options``: the upload as the save's
    handle times it (``upload_s``), the restore as ``load()`` on a new ``local_dir``."""
    with CheckpointEngine(base / "a", remote_url=url, storage_options=s3, direct_io="off", **options) as engine:
        handle = engine.save(state, step=1)
        handle.wait()
        engine.wait()
    up = handle.stats.upload_s  # the upload alone (shards, records, manifest): the local write varies more than it
    with CheckpointEngine(base / "fresh", remote_url=url, storage_options=s3, **options) as engine:
        t0 = time.perf_counter()
        loaded = engine.load()
        down = time.perf_counter() - t0
    assert_state_equal(loaded, state)
    return up, down


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--link-mbps", type=float, nargs="+", default=[100.0, 500.0])
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; the tables give medians")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mib, args.link_mbps = 16, [200.0]
    os.environ.update(CREDENTIALS)
    state = trained_state(args.mib, max(20, args.steps))
    variants = {"none": {}, "zstd": {"remote_compression": "zstd"}, "aes": {"remote_encryption_key": KEY},
                "zstd+aes": {"remote_compression": "zstd", "remote_encryption_key": KEY}}
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, codec threads {codec_files.threads()}, "
          f"state {sum(t.numel() * t.element_size() for t in _tensors(state)) / MB:.0f} MB "
          f"(bf16 weights, fp32 AdamW moments after {max(20, args.steps)} steps)")
    with tempfile.TemporaryDirectory() as tmp:
        with CheckpointEngine(Path(tmp) / "local", direct_io="off") as engine:
            engine.save(state, step=1).wait()
        ckpt = Path(tmp) / "local" / f"step-{1:012d}"
        raw = sum(p.stat().st_size for p in ckpt.iterdir() if p.suffix == ".safetensors")
        print("\n| codec | stored bytes | vs raw | compress MB/s/core | decompress MB/s/core |\n|---|---|---|---|---|")
        print(f"| none | {raw / MB:.1f} MB | 1.000 | - | - |")
        for name, opts in list(variants.items())[1:]:
            codec = Codec(opts.get("remote_compression"), opts.get("remote_encryption_key") and SecretKey(KEY))
            stored, c, d = rates(ckpt, codec)
            print(f"| {name} | {stored / MB:.1f} MB | {stored / raw:.3f} | {c:.0f} | {d:.0f} |")
        import s3fs

        with moto_server() as endpoint:
            s3 = {"client_kwargs": {"endpoint_url": endpoint}}
            fs = s3fs.S3FileSystem(**s3, skip_instance_cache=True)
            links: list[tuple[str, Link | None]] = [("moto as is", None)] + [
                (f"{r:.0f} MB/s link", Link(r * MB)) for r in args.link_mbps]
            times: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for round_ in range(args.repeat):  # interleaved: noise from the machine falls on every row alike
                for label, link in links:
                    for name, opts in variants.items():
                        throttle(link)
                        bucket = f"bench-{os.urandom(4).hex()}"
                        fs.mkdir(bucket)
                        try:
                            with tempfile.TemporaryDirectory() as work:
                                times.setdefault((label, name), []).append(
                                    round_trip(Path(work), f"s3://{bucket}/run", state, opts, s3))
                        finally:
                            throttle(None)
                print(f"round {round_ + 1}/{args.repeat} done", file=sys.stderr, flush=True)
            print("\n| link | codec | upload s | vs none | restore s | vs none |\n|---|---|---|---|---|---|")
            for label, _ in links:  # medians of the rounds, and their range
                up0, down0 = (statistics.median(t[k] for t in times[(label, "none")]) for k in (0, 1))
                for name in variants:
                    ups, downs = ([t[k] for t in times[(label, name)]] for k in (0, 1))
                    up, down = statistics.median(ups), statistics.median(downs)
                    print(f"| {label} | {name} | {up:.2f} ({min(ups):.2f}–{max(ups):.2f}) | {up / up0:.2f}x | "
                          f"{down:.2f} ({min(downs):.2f}–{max(downs):.2f}) | {down / down0:.2f}x |")
    return 0


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


if __name__ == "__main__":
    sys.exit(main())
