"""Small helpers shared by the data generators: stable seeding, the cache folder, atomic writes.

Python's ``hash()`` is salted per process, so every seed that must agree between a FLARE server, its
clients and a rerun tomorrow is derived with :func:`stable_seed` (SHA-256) instead.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile
import uuid
from typing import Callable

from medflare import DataError

CACHE_ENV = "MEDFLARE_CACHE"
DATA_ENV = "MEDFLARE_DATA"


def stable_seed(*parts: object) -> int:
    """A 63-bit integer seed derived from ``parts`` by SHA-256; identical in every process and run."""
    text = "\x1f".join(repr(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


def cache_root() -> pathlib.Path:
    """Where generated default data lives: ``$MEDFLARE_CACHE`` or ``~/.cache/medflare``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "medflare"


def param_tag(**params: object) -> str:
    """A folder name that encodes generator parameters, so different parameters never share a cache."""
    return "_".join(f"{k}{v}" for k, v in params.items()).replace("/", "-").replace(" ", "")


def ensure_generated(final_dir: pathlib.Path, marker: str, generate: Callable[[pathlib.Path], object]) -> pathlib.Path:
    """Return ``final_dir`` after making sure ``final_dir/marker`` exists, generating it if needed.

    ``generate(tmp_dir)`` writes everything into a fresh temporary sibling folder which is then renamed
    onto ``final_dir`` in one step; the rename is atomic, so concurrent simulator clients generating
    the same data never see a half-written folder, and the loser of a race discards its own copy.
    """
    final_dir = pathlib.Path(final_dir)
    if (final_dir / marker).exists():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}-", dir=final_dir.parent))
    try:
        generate(tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not (final_dir / marker).exists():  # not a lost race: a stale or foreign folder is in the way
                raise DataError(f"cache folder {final_dir} exists but holds no {marker}; delete it and rerun")
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir
