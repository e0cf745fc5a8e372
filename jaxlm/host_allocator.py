"""glibc malloc settings that keep XLA:CPU's per-call buffers mapped between calls (opt-in).

XLA:CPU allocates each execution's temporary buffer (one block for all of a program's
intermediates) with ``posix_memalign`` on the thread that runs it, and frees it at the end
of the call. glibc serves a block above its mmap threshold (at most 32 MiB) with a fresh
``mmap``, and a thread's arena cannot hold more than 64 MiB at all, so such a block is mapped,
first-touched one 4 KiB page fault at a time, and unmapped again on every call. Measured on
the quickstart-shape SFT step: an 89 MB block, ~22,700 page faults and about a third of the
step's time.

`configure_host_allocator` makes every thread allocate from glibc's main heap
(``M_ARENA_MAX=1``), serves large blocks from that heap instead of ``mmap``
(``M_MMAP_MAX=0``) and keeps up to `TRIM_THRESHOLD` bytes of free memory at its top
(``M_TRIM_THRESHOLD``), so the block of one call is reused by the next with no page faults
(once the heap has settled, after a few dozen calls; XLA's threads free and allocate in varying
order, so a call now and then still grows it).
The price is memory: freed blocks stay with the process, and the heap fragments. Measured:
the quickstart-shape SFT loop holds 800 MB instead of 650 MB; a loop of calls with ~200 MB of
temporaries grew to 2.1 GB instead of 0.55 GB before it levelled off. Hence opt-in.

Threads take their arena at their first allocation, so the settings must be made before JAX
starts its CPU client: ``import jaxlm`` reads ``JAXLM_HOST_ALLOCATOR``
(`configure_from_environment`): ``system`` (the default) keeps glibc's behaviour, ``tuned``
applies the settings, ``auto`` applies them when the installed JAX has no GPU or TPU plugin
(the ``jaxlm`` command's training verbs default to ``auto``). Off glibc (macOS, musl) nothing
changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform

#: ``JAXLM_HOST_ALLOCATOR`` values: ``system`` (glibc's defaults), ``tuned``, ``auto`` (tuned on
#: CPU-only installs)
MODES = ("system", "tuned", "auto")
#: free bytes glibc may keep at the top of its heap before returning memory to the system
TRIM_THRESHOLD = 1 << 30

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")

_configured: bool = False


def configure_host_allocator() -> bool:
    """Apply the settings above (see the module docstring); True where glibc took them."""
    global _configured
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    _configured = _configured or ok
    return ok


def has_accelerator_plugin() -> bool:
    """Whether a JAX GPU or TPU plugin is installed (then host memory does not hold XLA's buffers)."""
    return any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def configure_from_environment() -> bool:
    """What ``import jaxlm`` runs: `configure_host_allocator` when ``JAXLM_HOST_ALLOCATOR`` is
    ``tuned``, or ``auto`` and no accelerator plugin is installed; nothing for ``system`` (the
    default)."""
    mode = os.environ.get("JAXLM_HOST_ALLOCATOR", "system").strip().lower() or "system"
    if mode not in MODES:
        raise ValueError(f"JAXLM_HOST_ALLOCATOR={mode!r} is invalid: must be one of {MODES}")
    if mode == "system" or (mode == "auto" and has_accelerator_plugin()):
        return False
    return configure_host_allocator()


def is_configured() -> bool:
    """Whether this process's allocator was tuned by `configure_host_allocator`."""
    return _configured
