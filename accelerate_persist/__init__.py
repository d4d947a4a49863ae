"""Adapter package; its plugin lands with its own issue. Nothing is exported yet."""

__all__: list[str] = []
