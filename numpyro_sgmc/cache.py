"""An opt-in persistent compilation cache: compiled functions kept on disk across processes.

Every compiled piece of the library is a module-level function of array arguments, so within
one process a second ``autotune`` or ``run_kernel`` call on data of the same shapes compiles
nothing. A new process compiles again (most of a first ``autotune`` call's time on a small
model); with the cache on, it loads the compilations from disk instead:

.. code-block:: python

    import numpyro_sgmc
    numpyro_sgmc.enable_compilation_cache()   # before the first autotune / MCMC.run

This is JAX's own persistent cache (``jax_compilation_cache_dir``), turned on for every
compilation however short; it caches JAX programs in general, not only this library's.
Entries are keyed by the program, the shapes and the JAX version, so a stale entry is never
used; delete the directory to reclaim the space.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

__all__ = ["enable_compilation_cache"]


def enable_compilation_cache(path: Optional[str] = None) -> str:
    """Turn on JAX's persistent compilation cache for every compilation.

    :param path: the cache directory (created if missing); default
        ``$XDG_CACHE_HOME/numpyro_sgmc/jax`` (``~/.cache/numpyro_sgmc/jax``).
    :return: the directory used.
    """
    if path is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "numpyro_sgmc", "jax")
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
