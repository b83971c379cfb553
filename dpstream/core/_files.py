"""File-system helpers shared by the core's file stores and the edges' durable files."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries to disk.

    A file created, renamed or removed in it survives a power loss only once its directory is
    synced too.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
