"""Run a script of ``bench/`` in a subprocess for a slow claim test and return its JSON
result. The subprocess compiles with XLA's default optimisation (this suite compiles at
level 0 for speed), so the numbers are the ones the docs report."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    return env


def train_recipe(recipe: str, *overrides: str) -> None:
    """``jaxlm train <recipe> *overrides`` in a subprocess (a judge or model a bench then reads)."""
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "train", recipe, *overrides], env=_env(),
                          capture_output=True, text=True, cwd=BENCH.parent, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_bench(name: str, *args: str) -> dict | list:
    """``python bench/<name> *args``; the JSON value (object or list) the script prints last
    (one line, or pretty-printed to the end of its output)."""
    proc = subprocess.run([sys.executable, str(BENCH / name), *args], env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"bench/{name} printed no JSON result:\n{proc.stdout[-3000:]}")
