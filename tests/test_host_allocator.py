"""`jaxlm.host_allocator`: with ``JAXLM_HOST_ALLOCATOR=tuned`` XLA:CPU's large per-call buffers
stay mapped between calls (counted in page faults by the kernel); the switch and its errors."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from jaxlm import host_allocator

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

# one jitted call with a 96 MiB temporary block (above a thread arena's 64 MiB); the heap
# settles after a few calls, then the faults of the last calls are counted
PROBE = textwrap.dedent("""
    import resource
    import jaxlm  # before JAX starts its CPU client
    import jax, jax.numpy as jnp
    x = jnp.ones((96 << 20) // 4, jnp.float32)
    f = jax.jit(lambda x: (jnp.cumsum(x * 2) * 3)[:10])
    for _ in range(25):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        f(x).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
""")


def _faults_per_call(mode: str) -> float:
    # optimised code (the suite's XLA_FLAGS compile unoptimised): the probe's time is its loop
    env = {**os.environ, "JAXLM_HOST_ALLOCATOR": mode, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_large_buffers_are_reused_without_page_faults():
    """With glibc's defaults every call maps its 96 MiB temporary afresh (one fault per 4 KiB
    page touched); tuned, once the heap has settled, the block of one call is reused by the next."""
    system, tuned = _faults_per_call("system"), _faults_per_call("tuned")
    assert system > 20_000, system  # the probe does touch fresh pages every call by default
    assert tuned < 0.01 * system, (tuned, system)


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("JAXLM_HOST_ALLOCATOR", "system")
    assert host_allocator.configure_from_environment() is False
    monkeypatch.setenv("JAXLM_HOST_ALLOCATOR", "sometimes")
    with pytest.raises(ValueError, match=r"JAXLM_HOST_ALLOCATOR='sometimes' is invalid: must be one of \('system', 'tuned', 'auto'\)"):
        host_allocator.configure_from_environment()


def test_default_keeps_glibc_defaults(monkeypatch):
    monkeypatch.delenv("JAXLM_HOST_ALLOCATOR", raising=False)
    assert host_allocator.configure_from_environment() is False
