"""The encryption key as the options hold it: never shown, never pickled as bytes.

``remote_encryption_key`` is 32 bytes or a callable returning them (a secrets manager, an environment variable read
when needed). :class:`SecretKey` holds either; its ``repr`` says only that a key is set, and pickling refuses a key
given as bytes (a spawned worker would carry it in the clear): a callable pickles as itself, which holds no key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from persist_core.errors import ConfigError

KEY_BYTES = 32
OPTION = "remote_encryption_key"


class SecretKey:
    """A 32-byte AES-256 key, or a callable returning one (called when the key is first needed, once)."""

    __slots__ = ("_given", "_key")

    def __init__(self, given: bytes | bytearray | Callable[[], bytes]) -> None:
        if isinstance(given, SecretKey):
            given = given._given
        if isinstance(given, (bytes, bytearray)):
            _check(bytes(given))
            given = bytes(given)
        elif not callable(given):
            raise ConfigError(f"{OPTION} must be {KEY_BYTES} bytes or a callable returning them, not a "
                              f"{type(given).__name__} (its value is not shown); e.g. os.urandom({KEY_BYTES}) kept in "
                              "a secrets manager, or lambda: bytes.fromhex(os.environ['PERSIST_KEY'])")
        self._given = given
        self._key: bytes | None = given if isinstance(given, bytes) else None

    def bytes(self) -> bytes:
        """The key (a callable's, called once and checked)."""
        if self._key is None:
            try:
                key = self._given()  # type: ignore[operator]
            except Exception as e:  # its message is not shown: it may hold the key
                raise ConfigError(f"{OPTION}: the callable given raised {type(e).__name__}; fix it so it returns "
                                  f"the {KEY_BYTES}-byte key") from None
            if not isinstance(key, (bytes, bytearray)):
                raise ConfigError(f"{OPTION}: the callable given returned a {type(key).__name__}, not "
                                  f"{KEY_BYTES} bytes (e.g. bytes.fromhex(...) of 64 hex digits)")
            self._key = _check(bytes(key))
        return self._key

    def __repr__(self) -> str:
        return f"<{OPTION}: set, not shown>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKey) and (other._given is self._given or other._given == self._given)

    def __hash__(self) -> int:
        return hash(OPTION)

    def __copy__(self) -> SecretKey:
        return self  # immutable; a copy in this process carries nothing anywhere

    def __deepcopy__(self, memo: dict[int, Any]) -> SecretKey:
        return self

    def __reduce__(self) -> Any:
        if isinstance(self._given, bytes):
            raise TypeError(f"{OPTION} is not pickled (it would travel in the clear): pass it as a callable that "
                            "returns the key (e.g. read from an environment variable or a secrets manager), which "
                            "pickles as itself")
        return (SecretKey, (self._given,))


def _check(key: bytes) -> bytes:
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{OPTION} has {len(key)} bytes; AES-256 needs {KEY_BYTES} (e.g. os.urandom({KEY_BYTES}); "
                    "its value is not shown)")
    return key
