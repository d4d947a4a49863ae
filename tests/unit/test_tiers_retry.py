"""Only transport and throttling failures are retried; a bug fails at its first attempt."""

from __future__ import annotations

import errno
import uuid

import pytest
import torch

from persist_core import CheckpointEngine, RemoteError
from persist_core.tiers._retry import is_transient, retry
from persist_core.tiers.remote import RemoteTier


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def _translated(status: int, code: str) -> Exception:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error(status, code))  # what s3fs raises: an OSError from the ClientError


def _botocore(name: str) -> Exception:
    import botocore.exceptions as b

    kwargs = {"endpoint_url": "http://x"}
    return getattr(b, name)(**kwargs)


@pytest.mark.parametrize(("make", "transient"), [
    (lambda: ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (lambda: ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
    (lambda: TimeoutError("timed out"), True),
    (lambda: OSError(errno.ECONNRESET, "reset"), True),
    (lambda: OSError(errno.EPIPE, "broken pipe"), True),
    (lambda: OSError(errno.ETIMEDOUT, "timed out"), True),
    (lambda: _botocore("EndpointConnectionError"), True),
    (lambda: _botocore("ConnectTimeoutError"), True),
    (lambda: _botocore("ReadTimeoutError"), True),
    (lambda: _botocore("ConnectionClosedError"), True),
    (lambda: _client_error(503, "SlowDown"), True),
    (lambda: _client_error(500, "InternalError"), True),
    (lambda: _client_error(400, "Throttling"), True),
    (lambda: _client_error(400, "RequestTimeout"), True),
    (lambda: _translated(503, "SlowDown"), True),
    (lambda: _client_error(403, "AccessDenied"), False),
    (lambda: _translated(404, "NoSuchBucket"), False),
    (lambda: TypeError("a bug"), False),
    (lambda: ValueError("bad value"), False),
    (lambda: PermissionError("denied"), False),
    (lambda: OSError(errno.ENOSPC, "no space"), False),
    (lambda: KeyError("x"), False),
])
def test_which_failures_are_transient(make, transient):
    assert is_transient(make()) is transient


def test_a_type_error_fails_at_the_first_attempt_and_a_reset_is_retried():
    calls = []

    def bug():
        calls.append(1)
        raise TypeError("unsupported operand")

    with pytest.raises(RemoteError, match="TypeError: unsupported operand") as info:
        retry("uploading", "memory://x", bug, attempts=5, backoff_s=0.0, sleep=lambda s: None)
    assert len(calls) == 1 and "check the network" not in str(info.value)

    resets = []

    def flaky():
        resets.append(1)
        if len(resets) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset by peer")
        return "ok"

    assert retry("uploading", "memory://x", flaky, attempts=5, backoff_s=0.0, sleep=lambda s: None) == "ok"
    assert len(resets) == 3


def test_an_upload_that_hits_a_bug_is_attempted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "5")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "1")
    attempts = []

    def put(self, local, target):
        attempts.append(target)
        raise TypeError("a bug in a backend")

    monkeypatch.setattr(RemoteTier, "_put", put)
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "60000")  # the background retry of the checkpoint waits
    engine = CheckpointEngine(tmp_path, remote_url=f"memory://retry/{uuid.uuid4().hex}", remote_timeout_s=0.2)
    handle = engine.save({"w": torch.ones(10)}, step=1)
    with pytest.raises(RemoteError, match="TypeError: a bug in a backend"):
        handle.wait()
    assert len(attempts) == 1  # not retried as if it were the network
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):
        engine.close()
