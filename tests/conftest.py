"""The fixtures every test may use: a checkpoint directory, the moto S3 server, a bucket, a faulty proxy.

Helpers live in ``tests/support/`` (states, fakes, the moto server, child scripts).
"""

from __future__ import annotations

import os
import signal
import threading
import uuid

import fsspec

import pytest

from tests.support.moto_server import CREDENTIALS, FaultyProxy, moto_server



#: fixtures that start a server (the moto S3 server, a proxy in front of it)
_SERVER_FIXTURES = {"s3_endpoint", "bucket", "s3_options", "proxy"}


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` what ``make test-quick`` leaves out: the adapters' tests (a real Trainer, Accelerator or
    HF Trainer, often several processes), the integration tests (processes killed, servers, CLI runs), the
    root tests (examples and benchmarks run as processes) and every test that uses the moto server. A unit test
    that starts a process, or takes a second or more, carries ``@pytest.mark.slow`` itself."""
    for item in items:
        parts = item.path.relative_to(item.config.rootpath).parts
        if (parts[1] in ("adapters", "integration") or len(parts) == 2 or _SERVER_FIXTURES & set(item.fixturenames)
                or "[s3]" in item.name):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. A Lightning ``Trainer`` run in-process sets
    ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK`` and ``OMP_NUM_THREADS`` and never unsets
    them; a later test's child process inherited them, and its ``Accelerator`` tried to start a process group
    on that port, still held (``EADDRINUSE``)."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test leaves the SIGTERM and SIGINT handlers as it found them: an engine a test did not close left its
    flush handler installed, and a later test's forked child ran it (and wrote into a pipe another test read)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        if handler is not None:
            signal.signal(s, handler)


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


# ---- S3: one moto server per session, a fresh bucket per test


@pytest.fixture(scope="session")
def s3_endpoint():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        with moto_server() as endpoint:
            yield endpoint


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    import s3fs

    for k, v in CREDENTIALS.items():  # again per test: a session started inside a test (getfixturevalue) set
        monkeypatch.setenv(k, v)       # them after _environment_restored saved the environment, which then dropped them

    name = f"test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    fs.mkdir(name)
    return name


@pytest.fixture
def s3_options(s3_endpoint):
    return {"client_kwargs": {"endpoint_url": s3_endpoint}}


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultyProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    yield p
    p.close()


# ---- a remote of each kind the engine accepts


@pytest.fixture(params=["memory", "file", "s3"])
def remote_url(request, tmp_path, monkeypatch, s3_endpoint):
    """(``s3_endpoint`` is asked for up front, a session fixture: asked for lazily, the credentials it sets
    would be undone by ``_environment_restored`` after this test.) A remote_url on each kind of backend the engine accepts: fsspec's memory and
    local file systems (no server-side copy of a directory) and S3 (the moto server, through s3fs)."""
    if request.param == "file":
        yield f"file://{tmp_path}/remote/run"
        return
    if request.param == "s3":
        bucket = request.getfixturevalue("bucket")
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_endpoint})  # every s3fs the engine opens
        yield f"s3://{bucket}/run"
        return
    yield from _memory_url()


@pytest.fixture
def memory_url():
    """A remote_url on fsspec's memory file system of its own, emptied after the test."""
    yield from _memory_url()


def _memory_url():
    root = f"/persist-tests/{uuid.uuid4().hex}/run"
    yield f"memory://{root}"
    store = fsspec.filesystem("memory").store
    for key in [k for k in store if k.startswith(root)]:
        del store[key]
