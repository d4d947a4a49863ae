"""One stored block: the bytes of one checksum block of a shard file as the remote holds them.

Compress, then encrypt::

    stored = plain                                  (no key)
           | nonce(12) + AES-256-GCM(plain, aad)    (a key)
    plain  = kind(1) + payload
    kind   = 0: payload is the raw bytes; 1..8: zstd (with a frame checksum) of the bytes split into that many
             byte planes (1: no split)

The associated data names the block by an identity that a set-aside rename keeps (not its path): the run, the
save (one id per committed checkpoint), the file and the block index; so a block moved within a checkpoint, or
into another one, fails authentication. A block that compresses to no fewer bytes is stored raw (kind 0).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from typing import Any

from persist_core.errors import ConfigError, CorruptCheckpointError, PersistError
from persist_core.tiers.codec import planes
from persist_core.tiers.codec.key import OPTION, SecretKey

NONCE_BYTES = 12
COMPRESSIONS = (None, "zstd")
_LEVEL = 1  # zstd's fastest level with its full entropy coding: the link, not the ratio, sets the pace


class EncryptionKeyError(PersistError):
    """The remote is encrypted and no key, or another key, was given (``remote_encryption_key``)."""


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise ConfigError(f"remote_compression='zstd' needs the zstandard package ({e}); pip install "
                          "'torch-persist[compress]'") from None
    return zstandard


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:
        raise ConfigError(f"{OPTION} needs the cryptography package ({e}); pip install "
                          "'torch-persist[encrypt]'") from None
    return AESGCM


def check_compression(value: object) -> str | None:
    """``remote_compression`` checked (and its package importable)."""
    if value not in COMPRESSIONS:
        raise ConfigError(f"remote_compression={value!r} must be 'zstd' or None")
    if value == "zstd":
        _zstd()
    return value  # type: ignore[return-value]


class Codec:
    """How blocks and records are turned into stored bytes and back.

    Args:
        compression: ``"zstd"`` or ``None``; what is written (reads follow what each object says).
        key: the :class:`SecretKey`, or ``None``.
    """

    def __init__(self, compression: str | None = None, key: SecretKey | None = None) -> None:
        self.compression = check_compression(compression)
        self.key = key
        if key is not None:
            _aesgcm()
        self._local = threading.local()  # per thread: zstd contexts are not shared between threads

    @property
    def active(self) -> bool:
        """Anything to do on upload (else objects are written as they are on disk, the layout before issue 56)."""
        return self.compression is not None or self.key is not None

    def __repr__(self) -> str:
        return f"Codec(compression={self.compression!r}, encrypted={self.key is not None})"

    def __reduce__(self) -> Any:
        return (Codec, (self.compression, self.key))

    # ------------------------------------------------------------------ keys

    def _aead(self, what: str) -> Any:
        if self.key is None:
            raise EncryptionKeyError(f"{what} is encrypted and no {OPTION} was given; pass the key the run wrote "
                                     "it with (persist: --encryption-key-env NAME)")
        aead = getattr(self._local, "aead", None)
        if aead is None:
            aead = self._local.aead = _aesgcm()(self.key.bytes())
        return aead

    def key_check(self) -> str:
        """A short public fingerprint of the key (an HMAC of a constant): tells a wrong key from a tampered object."""
        assert self.key is not None
        return hmac.new(self.key.bytes(), b"torch-persist key check", hashlib.sha256).hexdigest()[:16]

    def check_key(self, expected: str | None, what: str) -> None:
        """Raise :class:`EncryptionKeyError` when ``what`` (encrypted, ``expected``: its key check) needs another key."""
        self._aead(what)
        if expected is not None and not hmac.compare_digest(expected, self.key_check()):
            raise EncryptionKeyError(f"{what} was encrypted with another {OPTION} than the one given; pass the key "
                                     "the run wrote it with (persist: --encryption-key-env NAME)")

    def seal(self, plain: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead("the remote").encrypt(nonce, plain, aad)

    def open(self, sealed: bytes | memoryview, aad: bytes, *, where: str) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead(where).decrypt(bytes(sealed[:NONCE_BYTES]), bytes(sealed[NONCE_BYTES:]), aad)
        except InvalidTag:
            raise CorruptCheckpointError(f"{where} does not authenticate: it was altered, moved from another "
                                         "checkpoint or block, or is not this run's (it is not loaded)") from None

    # ------------------------------------------------------------------ blocks

    def encode(self, data: memoryview | bytes, width: int, aad: bytes) -> bytes:
        """One block's stored bytes (see the module)."""
        plain = b"\x00" + bytes(data)
        if self.compression == "zstd":
            packed = self._compressor().compress(planes.split(data, width))
            if len(packed) + 1 < len(plain):
                plain = bytes([max(1, width)]) + packed
        return self.seal(plain, aad) if self.key is not None else plain

    def decode(self, stored: bytes | memoryview, aad: bytes, *, encrypted: bool, size: int, where: str) -> bytes:
        """The ``size`` logical bytes of one block from its stored bytes.

        Raises:
            CorruptCheckpointError: it does not authenticate or decode to ``size`` bytes.
            EncryptionKeyError: it is encrypted and there is no key.
        """
        plain = self.open(stored, aad, where=where) if encrypted else bytes(stored)
        if not plain:
            raise CorruptCheckpointError(f"{where}: an empty stored block")
        kind, payload = plain[0], memoryview(plain)[1:]
        if kind == 0:
            out = bytes(payload)
        elif kind <= 8:
            dctx = self._decompressor()  # no zstandard: a ConfigError naming the extra, not a corrupt block
            try:
                out = planes.join(dctx.decompress(payload, max_output_size=size), kind)
            except Exception as e:  # zstandard.ZstdError: a corrupt frame (its checksum, or its structure)
                raise CorruptCheckpointError(f"{where}: the compressed block does not decode ({e})") from None
        else:
            raise CorruptCheckpointError(f"{where}: unknown block kind {kind}")
        if len(out) != size:
            raise CorruptCheckpointError(f"{where}: decodes to {len(out)} bytes, {size} expected")
        return out

    def _compressor(self) -> Any:
        c = getattr(self._local, "cctx", None)
        if c is None:
            c = self._local.cctx = _zstd().ZstdCompressor(level=_LEVEL, write_checksum=True)
        return c

    def _decompressor(self) -> Any:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = _zstd().ZstdDecompressor()
        return d


def block_aad(run: str, save: str, file: str, index: int) -> bytes:
    """The identity a block is authenticated as (see the module)."""
    return f"torch-persist block\x00{run}\x00{save}\x00{file}\x00{index}".encode()
