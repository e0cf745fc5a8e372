"""Shared test setup: CPU only, quiet libraries, tiny HF reference models built in code."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On CPU the suite's time goes mostly to XLA compiling many tiny programs. Compile them
# with LLVM unoptimised (the HLO passes, and so fusion and buffer assignment, are unchanged;
# about a third less time in total) and let the test processes and the subprocesses they
# start (CLI verbs, 8-device checks) share compiled programs through JAX's persistent cache.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jaxlm-tests-xla-cache-{os.getuid()}"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
