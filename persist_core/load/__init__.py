"""The load flow: list -> choose -> read -> verify -> assemble (see DESIGN.md, "Layout")."""

from persist_core.load.reader import CheckpointReader

__all__ = ["CheckpointReader"]
