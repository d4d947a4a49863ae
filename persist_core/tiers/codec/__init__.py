"""What the remote tier does to the bytes it stores (issue 56): lossless compression per checksum block (byte planes
for floating dtypes, then zstd), client-side AES-256-GCM per block, and the envelope around the remote's manifest
that records both (the logical manifest inside is the one the local tier holds).

The local tier never sees any of it: its files stay raw (a restore there runs at the disk's speed).
"""

from __future__ import annotations

from persist_core.tiers.codec.blocks import Codec, EncryptionKeyError, block_aad, check_compression
from persist_core.tiers.codec.envelope import Envelope
from persist_core.tiers.codec.key import SecretKey

__all__ = ["Codec", "EncryptionKeyError", "Envelope", "SecretKey", "block_aad", "check_compression"]
