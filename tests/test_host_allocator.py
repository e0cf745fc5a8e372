"""`jaxlm.host_allocator`: with ``JAXLM_HOST_ALLOCATOR=tuned`` XLA:CPU's large per-call buffers
stay mapped between calls (counted in page faults by the kernel); the switch and its errors."""

import os
import platform
import statistics
import subprocess
import sys
import textwrap

import pytest

from jaxlm import host_allocator

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

# one jitted call with a 96 MiB temporary block (above a thread arena's 64 MiB). Tuned, the
# shared heap takes a few dozen calls to settle (a call now and then still grows it while XLA's
# threads free and allocate in varying order), so the faults of each of the last calls are
# counted and their median is compared
PROBE = textwrap.dedent("""
    import resource
    import jaxlm  # before JAX starts its CPU client
    import jax, jax.numpy as jnp
    x = jnp.ones((96 << 20) // 4, jnp.float32)
    f = jax.jit(lambda x: (jnp.cumsum(x * 2) * 3)[:10])
    for _ in range(40):
        f(x).block_until_ready()
    faults = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
""")


def _faults_per_call(mode: str) -> list[int]:
    # optimised code (the suite's XLA_FLAGS compile unoptimised): the probe's time is its loop
    env = {**os.environ, "JAXLM_HOST_ALLOCATOR": mode, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.strip().splitlines()[-1].split()]


@glibc_only
def test_large_buffers_are_reused_without_page_faults():
    """With glibc's defaults every call maps its 96 MiB temporary afresh (one fault per 4 KiB
    page touched); tuned, once the heap has settled, the block of one call is reused by the next
    (the typical call faults on no fresh page)."""
    system, tuned = _faults_per_call("system"), _faults_per_call("tuned")
    assert min(system) > 20_000, system  # the probe does touch fresh pages every call by default
    assert statistics.median(tuned) < 0.01 * statistics.median(system), (tuned, system)


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("JAXLM_HOST_ALLOCATOR", "system")
    assert host_allocator.configure_from_environment() is False
    monkeypatch.setenv("JAXLM_HOST_ALLOCATOR", "sometimes")
    with pytest.raises(ValueError, match=r"JAXLM_HOST_ALLOCATOR='sometimes' is invalid: must be one of \('system', 'tuned', 'auto'\)"):
        host_allocator.configure_from_environment()


def test_default_keeps_glibc_defaults(monkeypatch):
    monkeypatch.delenv("JAXLM_HOST_ALLOCATOR", raising=False)
    assert host_allocator.configure_from_environment() is False
