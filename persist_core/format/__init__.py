"""The versioned on-disk contract: the tree encoding, the shard file layout, the manifest."""

from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.shard_file import FORMAT_NAME, FORMAT_VERSION
from persist_core.format.tree import FlatState, flatten, unflatten

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FileEntry", "FlatState", "Manifest", "flatten", "unflatten"]
