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

import numpy as np

from persist_core.errors import ConfigError, CorruptCheckpointError, PersistError
from persist_core.tiers.codec import planes
from persist_core.tiers.codec.key import OPTION, SecretKey

NONCE_BYTES = 12
_TAG_BYTES = 16  # AES-GCM's tag, after the ciphertext
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

    def encode(self, data: memoryview | bytes, width: int, aad: bytes) -> bytes | bytearray:
        """One block's stored bytes (see the module). One copy of the block's bytes besides the codec's own work:
        the byte planes are split by numpy into a fresh array and AES-GCM encrypts into the output."""
        kind, body = 0, data
        if self.compression == "zstd":
            split = data if width <= 1 else planes.split_into(data, width, np.empty(len(data), dtype=np.uint8))
            packed = self._compressor().compress(split)
            if len(packed) < len(data):
                kind, body = max(1, width), packed
        plain = bytes((kind,)) + body
        if self.key is None:
            return plain
        out = bytearray(NONCE_BYTES + len(plain) + _TAG_BYTES)
        out[:NONCE_BYTES] = nonce = os.urandom(NONCE_BYTES)
        self._aead("the remote").encrypt_into(nonce, plain, aad, memoryview(out)[NONCE_BYTES:])
        return out

    def decode(self, stored: bytes | memoryview, aad: bytes, *, encrypted: bool, size: int, where: str) -> bytes:
        """The ``size`` logical bytes of one block from its stored bytes.

        Raises:
            CorruptCheckpointError: it does not authenticate or decode to ``size`` bytes.
            EncryptionKeyError: it is encrypted and there is no key.
        """
        out = bytearray(size)
        self.decode_into(stored, aad, encrypted=encrypted, out=memoryview(out), where=where)
        return bytes(out)

    def decode_into(self, stored: bytes | memoryview, aad: bytes, *, encrypted: bool, out: memoryview,
                    where: str) -> None:
        """Decode one block's stored bytes into ``out`` (a writable byte view of the block's logical length): the
        planes are joined by numpy straight into it (no intermediate bytes object).

        Raises:
            CorruptCheckpointError: it does not authenticate or decode to ``len(out)`` bytes.
            EncryptionKeyError: it is encrypted and there is no key.
        """
        size = out.nbytes
        if encrypted:
            from cryptography.exceptions import InvalidTag

            sealed = memoryview(stored)
            if len(sealed) < NONCE_BYTES + _TAG_BYTES:
                raise CorruptCheckpointError(f"{where}: a stored block of {len(sealed)} bytes is too short to be one")
            plain = memoryview(bytearray(len(sealed) - NONCE_BYTES - _TAG_BYTES))
            try:
                self._aead(where).decrypt_into(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad, plain)
            except InvalidTag:
                raise CorruptCheckpointError(f"{where} does not authenticate: it was altered, moved from another "
                                             "checkpoint or block, or is not this run's (it is not loaded)") from None
        else:
            plain = memoryview(stored)
        if not len(plain):
            raise CorruptCheckpointError(f"{where}: an empty stored block")
        kind, payload = plain[0], plain[1:]
        if kind == 0:
            if len(payload) != size:
                raise CorruptCheckpointError(f"{where}: decodes to {len(payload)} bytes, {size} expected")
            out.cast("B")[:] = payload
        elif kind <= 8:
            dctx = self._decompressor()  # no zstandard: a ConfigError naming the extra, not a corrupt block
            try:
                raw = dctx.decompress(payload, max_output_size=size)
            except Exception as e:  # zstandard.ZstdError: a corrupt frame (its checksum, or its structure)
                raise CorruptCheckpointError(f"{where}: the compressed block does not decode ({e})") from None
            if len(raw) != size:
                raise CorruptCheckpointError(f"{where}: decodes to {len(raw)} bytes, {size} expected")
            planes.join_into(raw, kind, np.frombuffer(out.cast("B"), dtype=np.uint8))
        else:
            raise CorruptCheckpointError(f"{where}: unknown block kind {kind}")

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
