"""The installed package's version: what ``room-outbox --version`` prints, and what every span
and metric carries as ``service.version``."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """room-outbox's installed version ("unknown" in a source tree that was never installed)."""
    try:
        return importlib.metadata.version("room-outbox")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
