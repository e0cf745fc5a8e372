"""Sharding on 8 forced CPU devices, in one subprocess (the device count is fixed at JAX start)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.multidevice
def test_sharded_model_matches_single_device():
    script = Path(__file__).parent / "multidevice" / "sharded_checks.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL PASS" in proc.stdout
