"""Every tunable, validated here: environment overrides users should not need, and the engine's settings.

Each ``PERSIST_*`` variable is read once per engine (or remote tier), at construction, and a
bad value is a :class:`~persist_core.errors.ConfigError` naming the variable and its range.
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Mapping
from typing import Any

from persist_core.errors import ConfigError
from persist_core.layout import MAX_STEP as _layout_max_step, is_url

#: Alignment of the data section and of every O_DIRECT write (bytes).
PAGE_BYTES = 4096
#: Alignment of each tensor entry inside the data section (bytes); 64 divides every dtype size.
ENTRY_ALIGN_BYTES = 64
#: The largest step a checkpoint may have: the layout's (``layout.MAX_STEP``, what an int64 step counter holds,
#: 19 digits); a larger one would sort as the newest for good (every normal step after it refused as older).
MAX_STEP = _layout_max_step
#: The most threads one shard is written (or one reader reads) with: past the cores of any host, more only
#: cost memory and start-up (10**6 of them exhausted the process before the first write).
MAX_WRITE_THREADS = 256
#: The largest ``chunk_bytes``: Linux moves at most 2 GiB - 4 KiB in one pwrite, and a chunk is checksummed whole.
MAX_CHUNK_BYTES = 1 << 30
#: The most saves staged or writing at once: each holds a staging buffer the size of this rank's state.
MAX_PENDING = 64
#: an incremental save whose references would name more checkpoints than this is written full (loads stay fast)
INCREMENTAL_MAX_SPAN = 3


def _env_int(name: str, default: int, *, minimum: int, multiple: int = 1, what: str = "",
             maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or value % multiple or (maximum is not None and value > maximum):
        rule = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "") \
            + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ConfigError(f"environment variable {name}={raw!r} must be {rule}{what}; unset it for the default "
                          f"({default})")
    return value


def write_threads() -> int:
    """Threads that write (and checksum) chunks of one shard in parallel: ``PERSIST_WRITE_THREADS`` (1 to
    :data:`MAX_WRITE_THREADS`)."""
    return _env_int("PERSIST_WRITE_THREADS", 4, minimum=1, maximum=MAX_WRITE_THREADS)


def chunk_bytes() -> int:
    """Size of one pwrite and of one checksummed chunk: ``PERSIST_CHUNK_BYTES`` (multiple of 4 KiB, at most
    :data:`MAX_CHUNK_BYTES`)."""
    return _env_int("PERSIST_CHUNK_BYTES", 32 << 20, minimum=PAGE_BYTES, multiple=PAGE_BYTES, maximum=MAX_CHUNK_BYTES)


def direct_io() -> str:
    """``PERSIST_DIRECT_IO``: ``auto`` (try O_DIRECT, fall back), ``on`` or ``off``."""
    value = os.environ.get("PERSIST_DIRECT_IO", "auto").strip() or "auto"
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"environment variable PERSIST_DIRECT_IO={value!r} must be 'auto', 'on' or 'off'")
    return value


def check_writes(config: Any) -> None:
    """How a :class:`~persist_core.config.Config` writes: ``write_threads``, ``chunk_bytes``, ``direct_io``,
    ``max_pending``, ``verify``, ``remote_timeout_s`` and ``max_unsynced_bytes`` (a ConfigError naming the value)."""
    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    c = config
    if not whole(c.write_threads) or not 1 <= c.write_threads <= MAX_WRITE_THREADS:
        raise ConfigError(f"write_threads={c.write_threads!r} must be an int from 1 to {MAX_WRITE_THREADS} "
                          "(threads writing one shard; the default, 4, suits most NVMe disks)")
    if not whole(c.chunk_bytes) or not PAGE_BYTES <= c.chunk_bytes <= MAX_CHUNK_BYTES or c.chunk_bytes % PAGE_BYTES:
        raise ConfigError(f"chunk_bytes={c.chunk_bytes!r} must be a multiple of {PAGE_BYTES} from {PAGE_BYTES} to "
                          f"MAX_CHUNK_BYTES={MAX_CHUNK_BYTES} (the default, 32 MiB, suits most disks)")
    if c.direct_io not in ("auto", "on", "off"):
        raise ConfigError(f"direct_io={c.direct_io!r} must be 'auto', 'on' or 'off'")
    if isinstance(c.remote_timeout_s, bool) or not isinstance(c.remote_timeout_s, (int, float)) \
            or not c.remote_timeout_s > 0:
        raise ConfigError(f"remote_timeout_s={c.remote_timeout_s!r} must be a positive number of seconds")
    if c.max_unsynced_bytes is not None and (not whole(c.max_unsynced_bytes) or c.max_unsynced_bytes < 1):
        raise ConfigError(f"max_unsynced_bytes={c.max_unsynced_bytes!r} must be a positive int (bytes) or None")
    check_bool("verify", c.verify)
    if not whole(c.max_pending) or not 1 <= c.max_pending <= MAX_PENDING:
        raise ConfigError(
            f"max_pending={c.max_pending!r} must be an int from 1 to {MAX_PENDING} (each pending save holds one "
            "staging buffer the size of the state)"
        )


def check_incremental(config: Any) -> None:
    """``incremental`` and ``full_every`` of a :class:`~persist_core.config.Config`, and what incremental saves do
    take: a ConfigError naming the value and the fix."""
    c = config
    check_bool("incremental", c.incremental)
    if isinstance(c.full_every, bool) or not isinstance(c.full_every, int) or c.full_every < 1:
        raise ConfigError(f"full_every={c.full_every!r} must be an int >= 1: an incremental save writes a full "
                          "checkpoint at least every full_every saves (the default, 10; 1 writes every save full)")
    if not c.incremental:
        return


def check_backend(url: str) -> None:
    """An fsspec backend exists for ``url``'s scheme (``nosuch://x`` fails here, not at the first upload)."""
    import fsspec

    scheme = url.partition("://")[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as e:
        raise ConfigError(f"remote_url={url!r} is not an fsspec URL this machine can open: fsspec knows no protocol "
                          f"{scheme!r} ({e}); use s3://, gs://, az://, file:// or memory://") from e
    except ImportError as e:
        raise ConfigError(f"remote_url={url!r} needs an fsspec backend that is not installed ({e}); e.g. "
                          "pip install 'torch-persist[s3]' for s3://") from e


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (``verify="no"`` must not mean yes); else a ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def check_local_dir(value: object) -> os.PathLike[str] | str:
    """``value`` if it names a local directory; a ConfigError for ``None``, a non-path, a NUL in it or a URL."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"local_dir={value!r} must be a directory path (str or pathlib.Path), e.g. '/nvme/ckpt'")
    text = os.fspath(value)
    if isinstance(text, str) and "\x00" in text:
        raise ConfigError(f"local_dir={text!r} holds a NUL character, which no path can; pass e.g. '/nvme/ckpt'")
    if isinstance(text, str) and is_url(text):
        raise ConfigError(f"local_dir={text!r} is a URL; local_dir is a directory on this machine (ideally NVMe) and "
                          f"the URL goes in remote_url: local_dir='/nvme/ckpt', remote_url={text!r}")
    return value


def check_remote_url(value: object) -> str | None:
    """``value`` if it is ``None`` or a URL with a scheme and a bucket or path after it, without control
    characters (a NUL or a newline reaches no object store: found at the first upload, hours later); else a
    ConfigError."""
    if value is None:
        return None
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(f"remote_url={value!r} is not a URL; pass e.g. 's3://bucket/run-7' or "
                          "'file:///mnt/shared/run', or None for local only")
    bad = _CONTROL.search(value)
    if bad:
        raise ConfigError(f"remote_url={value!r} holds the control character {bad.group()!r} at {bad.start()}; "
                          "pass the URL without it, e.g. 's3://bucket/run-7'")
    scheme, _, rest = value.partition("://")
    if not scheme or not rest.strip("/"):
        raise ConfigError(f"remote_url={value!r} names no bucket or path after {scheme or 'its scheme'}://; pass e.g. "
                          f"'{scheme or 's3'}://bucket/run-7'")
    return value


def check_storage_options(value: object) -> dict | None:
    """``value`` if it is ``None`` or a dict (fsspec's keyword arguments); else a ConfigError."""
    if value is not None and not isinstance(value, dict):  # its type only: the value may hold credentials
        raise ConfigError(f"storage_options (a {type(value).__name__}) must be a dict of fsspec options, e.g. "
                          "{'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}}, or None")
    return value


def check_remote(remote_url: object, storage_options: object) -> None:
    """Both checked, and ``storage_options`` only with a ``remote_url`` (they configure nothing else: options
    for an endpoint given without the URL are a remote the user meant and does not have)."""
    check_remote_url(remote_url)
    check_storage_options(storage_options)
    if storage_options is not None and remote_url is None:  # its keys only: the values may hold credentials
        raise ConfigError(f"storage_options (keys {sorted(map(str, storage_options))}) were given without "
                          "remote_url; they configure the remote tier: pass remote_url='s3://bucket/run' too, or "
                          "drop storage_options")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: What a run id may hold: it is written into ``local_dir/.run-id`` and the remote's lease, and named in
#: errors; launchers' ids (a SLURM job id ``123_4``, a torchrun rendezvous id, a uuid) all fit.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")


def check_run_id(value: object, *, name: str = "run_id") -> str | None:
    """``value`` if it is ``None`` or a run id (1 to 128 of ``A-Z a-z 0-9 . _ : @ + = -``, a letter or digit
    first); else a ConfigError naming ``name`` (the keyword or the environment variable)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        raise ConfigError(f"{name}={value!r} is not a usable run id: it is kept in files and names, so it must be "
                          "1 to 128 letters, digits and . _ : @ + = - (starting with a letter or digit), e.g. "
                          "'run-7' or a job id")
    return value


def check_step(value: object, *, name: str = "step", what: str = "the training step") -> int:
    """``value`` as an int if it is a whole number from 0 to :data:`MAX_STEP` (``True`` is not step 1, nor
    ``1.0`` a step); else a ConfigError naming ``name``."""
    try:
        step = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        step = None
    if step is None:
        raise ConfigError(f"{name}={value!r} must be an int from 0 to MAX_STEP={MAX_STEP} ({what})")
    if step < 0:
        raise ConfigError(f"{name}={step!r} must be >= 0 ({what})")
    if step > MAX_STEP:
        raise ConfigError(f"{name}={step!r} is past MAX_STEP={MAX_STEP} ({what}): steps are named with at most "
                          f"{len(str(MAX_STEP))} digits, and one past them would be the newest for good; count steps from 0, not from a "
                          "timestamp in ns or a random number")
    return step


def check_resume_step(value: object, reader: Any) -> int:
    """``value`` as a step if it is committed on a tier of ``reader`` (a
    :class:`~persist_core.load.reader.CheckpointReader`; the step it loaded last counts without a listing);
    else a ConfigError naming the committed steps."""
    step = check_step(value, what="the committed step this run continues from")
    if step == reader.loaded_step:
        return step
    steps = [c.step for c in reader.list("local")]
    if step in reader.memory_steps():  # a snapshot in memory (the memory tier)
        return step
    if step not in steps and reader.remote_url is not None:
        steps = sorted({c.step for c in reader.list("all")})
    if step not in steps:
        where = str(reader.local_dir) + (f" nor {reader.remote_url}" if reader.remote_url else "")
        shown = ", ".join(map(str, steps[-10:])) or "none"
        raise ConfigError(f"resume_from({step}): no checkpoint of step {step} is committed in {where} (committed "
                          f"steps: {shown}{' ...' if len(steps) > 10 else ''}); pass one of them, or call load(), "
                          "which resumes from what it loads")
    return step


def memory_type_error(value: object) -> ConfigError:  # the engine's and the reader's check of ``memory``
    return ConfigError(f"memory={value!r} must be a MemoryTier (from persist_core import MemoryTier; "
                       "memory=MemoryTier(every_n_steps=1)) or None")


def check_timeout(value: object) -> float | None:
    """``value`` if it is ``None`` (no limit) or a number of seconds >= 0; else a ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"timeout={value!r} must be a number of seconds >= 0, or None to wait as long as it takes")
    return value


def check_signals(value: object) -> tuple[int, ...]:
    """``value`` as a tuple if it is a non-empty sequence of signals this process can catch (``signal.SIGTERM``,
    ``signal.SIGUSR1``); else a ConfigError (found at construction, not when the handler is installed)."""
    import signal

    if isinstance(value, (int, str)) or not isinstance(value, (tuple, list)) or not value:
        raise ConfigError(f"preemption_signals={value!r} must be a non-empty tuple of signals, e.g. (signal.SIGTERM,)")
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    for sig in value:
        if isinstance(sig, bool) or not isinstance(sig, int) or sig not in catchable:
            raise ConfigError(f"preemption_signals={tuple(value)!r}: {sig!r} is not a signal this process can catch; "
                              "pass e.g. (signal.SIGTERM,) or (signal.SIGTERM, signal.SIGUSR1)")
    return tuple(value)


def check_callable(**values: object) -> None:
    """Each value callable (a clock); else a ConfigError naming the keyword."""
    for name, value in values.items():
        if not callable(value):
            raise ConfigError(f"{name}={value!r} must be callable (a function returning seconds, e.g. time.monotonic)")


def check_into(value: object) -> Any:
    """``value`` if it is ``None``, a tensor or a dict / list / tuple of targets; else a ConfigError."""
    import torch

    if value is None or isinstance(value, (Mapping, list, tuple, torch.Tensor)):
        return value
    raise ConfigError(f"into={value!r} is not a state to load into: pass the targets shaped like the saved state "
                      "(e.g. {'model': model.state_dict()}), or None to load the whole state")


def check_map_location(value: object) -> Any:
    """``value`` if it is ``None`` or names a device torch knows (``"cpu"``, ``"cuda:0"``, a ``torch.device``)."""
    import torch

    if value is None:
        return None
    try:
        device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"map_location={value!r} is not a device ({e}); pass e.g. 'cpu', 'cuda:0' or a "
                          "torch.device") from e
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"map_location={value!r}: this process sees {torch.cuda.device_count()} CUDA device(s); "
                          "pass 'cpu' or one of them")
    return value


def remote_lease_s() -> int:
    """How long a writer's lease on ``remote_url`` lasts unrenewed: ``PERSIST_REMOTE_LEASE_S`` (>= 10 s)."""
    return _env_int("PERSIST_REMOTE_LEASE_S", 600, minimum=10)


def run_id_from_env() -> str | None:
    """The run's id from the launcher: ``PERSIST_RUN_ID``, else torchrun's or SLURM's job id, else ``None``.

    Raises:
        ConfigError: the id is not one :func:`check_run_id` takes (names the variable).
    """
    for name in ("PERSIST_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "").strip()
        if value and value != "none":
            return check_run_id(value, name=f"environment variable {name}")
    return None


def check_metadata(value: object) -> None:
    """``value`` must be ``None`` or a dict that JSON gives back as it is (it goes into the manifest as JSON):
    str keys at every depth (``{1: 'x'}`` would come back as ``{'1': 'x'}``), lists rather than tuples."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(f"metadata={value!r} must be a dict of JSON-able values (or None)")
    changed = _json_changes(value, "metadata")
    if changed:
        raise ConfigError(f"{changed}; JSON would give back something else: use str keys and list values, e.g. "
                          "metadata={'1': 'x', 'shape': [3, 4]}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata={value!r} cannot be written as JSON ({e}); keep str, number, bool, None, list "
                          "and dict values") from e


def _json_changes(value: Any, path: str, depth: int = 0) -> str | None:
    """Where ``value`` would not survive a JSON round trip as itself, or ``None``."""
    if depth > 100:
        return None  # json.dumps names what is too deep
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} has the key {key!r} (a {type(key).__name__})"
            found = _json_changes(item, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
    elif isinstance(value, tuple):
        return f"{path} is the tuple {value!r}"
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _json_changes(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
    return None
