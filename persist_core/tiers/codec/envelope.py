"""The remote's manifest object when a codec is on: an envelope around the same logical manifest.

The manifest a checkpoint has is the same on disk and on the remote (the load and set-aside paths compare them for
equality); what only the remote copy needs — each file's stored block lengths, the codec, the encryption header —
lives around it::

    MAGIC  header-length(4, little-endian)  header (JSON)  body
    header = {"step", "nbytes", "encrypted", "compression", "state", "key_check" | "crc"}
    body   = nonce + AES-256-GCM(inner, aad=header)    (encrypted: the header is authenticated, not hidden)
           | inner                                     (else: "crc" is the crc32c of the header without it, then inner)
    inner  = layout-length(4) layout (JSON: {"files": {file: [stored block lengths]}, "run", "save"})
             logical-manifest-bytes

The header holds only what a listing without the key shows (the step, its size, that it is encrypted) and what the
reader needs before it opens the body; the run's id and the save's id, which name the blocks, are inside. ``state`` is
``"live"`` or ``"abandoned"``: setting a checkpoint aside writes its envelope again as abandoned (the blocks are copied
as they are: their identity holds no path), so an abandoned checkpoint's objects put back at a live prefix are
refused. A manifest object without the magic is a plain manifest (a remote written without a codec).

Small records (the lease) are sealed alike: ``RECORD_MAGIC nonce AES-256-GCM(body, aad=their name)``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import crc32c

from persist_core.errors import CorruptCheckpointError
from persist_core.tiers.codec.blocks import Codec, EncryptionKeyError

MAGIC = b"torch-persist envelope 1\n"
RECORD_MAGIC = b"torch-persist record 1\n"


@dataclass(frozen=True)
class Envelope:
    """What a remote manifest object says besides the manifest."""

    step: int
    nbytes: int
    encrypted: bool
    compression: str | None
    run: str
    save: str
    state: str = "live"
    layout: dict[str, tuple[int, ...]] = field(default_factory=dict)  # file -> stored block lengths
    key_check: str | None = None

    def header(self) -> dict[str, Any]:
        """What is stored in the clear (authenticated): nothing of the run's lineage."""
        return {"step": self.step, "nbytes": self.nbytes, "encrypted": self.encrypted, "compression": self.compression,
                "state": self.state, "key_check": self.key_check}


def is_envelope(raw: bytes) -> bool:
    return raw.startswith(MAGIC)


def wrap(env: Envelope, manifest_bytes: bytes, codec: Codec) -> bytes:
    """The envelope object of ``env`` around ``manifest_bytes``."""
    layout = _dumps({"files": {k: list(v) for k, v in env.layout.items()}, "run": env.run, "save": env.save})
    inner = struct.pack("<I", len(layout)) + layout + manifest_bytes
    header = env.header()
    if env.encrypted:
        body = codec.seal(inner, _dumps({**header, "key_check": None}))  # the fingerprint is checked apart (unwrap)
        header["key_check"] = codec.key_check()
        head = _dumps(header)
    else:
        header["crc"] = crc32c.crc32c(inner, crc32c.crc32c(_dumps(header)))
        head = _dumps(header)
        body = inner
    return MAGIC + struct.pack("<I", len(head)) + head + body


def peek(raw: bytes, *, where: str) -> tuple[dict[str, Any], bytes, bytes]:
    """``(header, its bytes, body)`` of an envelope, nothing decrypted."""
    try:
        (n,) = struct.unpack_from("<I", raw, len(MAGIC))
        head = raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n]
        header = json.loads(head)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        int(header["step"]), int(header["nbytes"])
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: the envelope's header is corrupt ({e})") from None
    return header, head, raw[len(MAGIC) + 4 + n :]


def unwrap(raw: bytes, codec: Codec, *, where: str) -> tuple[Envelope, bytes]:
    """``(the envelope, the logical manifest's bytes)``.

    Raises:
        CorruptCheckpointError: altered, truncated, or (encrypted) not authentic.
        EncryptionKeyError: encrypted, and no key or another key.
    """
    header, head, body = peek(raw, where=where)
    if header.get("encrypted"):
        aad = _dumps({**header, "key_check": None})
        try:
            codec.check_key(header.get("key_check"), where)
        except EncryptionKeyError as wrong_key:
            if codec.key is None:
                raise
            try:  # another key, or this key's fingerprint altered: only the body can tell
                codec.open(body, aad, where=where)
            except CorruptCheckpointError:
                raise wrong_key from None
            raise CorruptCheckpointError(f"{where}: its key fingerprint was altered (refused)") from None
        inner = codec.open(body, aad, where=where)
        if _dumps(header) != head:
            raise CorruptCheckpointError(f"{where}: the envelope's header was altered (refused)")
    else:
        inner = body
        rest = {k: v for k, v in header.items() if k != "crc"}  # the header as written, before its crc was added
        if header.get("crc") != crc32c.crc32c(inner, crc32c.crc32c(_dumps(rest))) or _dumps(header) != head:
            raise CorruptCheckpointError(f"{where}: the envelope does not match its checksum; the copy is corrupt")
    try:
        (n,) = struct.unpack_from("<I", inner, 0)
        meta = json.loads(inner[4 : 4 + n])
        layout = {str(k): tuple(int(x) for x in v) for k, v in meta["files"].items()}
        run, save = str(meta["run"]), str(meta["save"])
    except (struct.error, ValueError, AttributeError, TypeError, KeyError) as e:
        raise CorruptCheckpointError(f"{where}: the envelope's layout is corrupt ({e})") from None
    env = Envelope(step=int(header["step"]), nbytes=int(header["nbytes"]), encrypted=bool(header.get("encrypted")),
                   compression=header.get("compression"), run=run, save=save, state=str(header.get("state", "live")),
                   layout=layout, key_check=header.get("key_check"))
    return env, inner[4 + n :]


def _dumps(obj: Any) -> bytes:
    """JSON as the envelope writes it (compact, keys in their order): written and checked alike."""
    return json.dumps(obj, separators=(",", ":")).encode()


def seal_record(body: bytes, name: str, codec: Codec) -> bytes:
    """A small record (the lease) as stored: sealed under its name when there is a key, else as it is."""
    if codec.key is None:
        return body
    return RECORD_MAGIC + codec.seal(body, f"torch-persist record\x00{name}".encode())


def open_record(raw: bytes, name: str, codec: Codec, *, where: str) -> bytes:
    """The inverse of :func:`seal_record`; a sealed record that does not authenticate raises."""
    if not raw.startswith(RECORD_MAGIC):
        if codec.key is not None:
            raise CorruptCheckpointError(f"{where} is not sealed with remote_encryption_key: it was written "
                                         "without the key, or altered (refused)")
        return raw
    return codec.open(raw[len(RECORD_MAGIC):], f"torch-persist record\x00{name}".encode(), where=where)
