"""Shared test setup: CPU only, quiet libraries, tiny HF reference models built in code."""

import faulthandler
import gc
import os
import signal
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On CPU the suite's time goes mostly to XLA compiling many tiny programs. Compile them
# with LLVM unoptimised (the HLO passes, and so fusion and buffer assignment, are unchanged;
# about a third less time in total) and let the test processes and the subprocesses they
# start (CLI verbs, 8-device checks) share compiled programs through JAX's persistent cache.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jaxlm-tests-xla-cache-{os.getuid()}"))
# Cache every program, not only those that took a second to compile (JAX's default): the
# same small programs recur across test files, workers and subprocesses. (A cold run writes
# ~150 MB there; no size limit, as JAX's eviction rescans the directory on every write.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: Test files by measured time, longest first. With reordering off (`pytest_configure`),
#: pytest-xdist's ``--dist loadfile`` hands files to the workers in collection order, so the
#: longest go first and the short ones fill in at the end. (Its default orders files by their
#: number of tests, which put the one-test multi-device and multi-host files last, with one
#: worker running alone for minutes.)
LONGEST_FILES = (
    "tests/test_multihost.py", "tests/test_multidevice.py", "tests/compress/test_a3.py",
    "tests/quant/test_qfit.py", "tests/quant/test_qat_export.py", "tests/quant/test_quantized_model.py",
    "tests/rl/test_prefix.py", "tests/quant/test_kernels.py", "tests/quant/test_transforms.py",
    "tests/trainers/test_quickstart.py", "tests/quant/test_twinquant_model.py", "tests/rl/test_multiturn.py",
    "tests/inference/test_generate.py", "tests/inference/test_speculative.py", "tests/inference/test_early_exit.py",
    "tests/inference/test_online_spec.py", "tests/inference/test_grammar.py", "tests/inference/test_diffusion.py",
    "tests/trainers/test_diffusion_training.py", "tests/models/test_omni.py", "tests/compress/test_omnisift.py",
    "tests/agents/test_agent_training.py",
    "tests/trainers/test_loop.py", "tests/trainers/test_step.py",
    "tests/rl/test_grpo.py", "tests/models/test_attention_fast_path.py", "tests/models/test_variants.py",
    "tests/editing/test_curvature.py", "tests/quant/test_formats.py", "tests/quant/test_quarot.py",
    "tests/quant/test_transformed_kernels.py", "tests/trainers/test_checkpoint_integrity.py",
    "tests/interp/test_attribution.py", "tests/models/test_transformer.py", "tests/editing/test_edit_methods.py",
    "tests/test_notebooks.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    root = config.rootpath

    def key(item):
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            rel = str(item.path)
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the other files, is kept


_STDERR_FD = pytest.StashKey[int]()


def pytest_configure(config):
    config.stash[_STDERR_FD] = os.dup(sys.__stderr__.fileno())  # output capture is off here
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --dist loadfile/loadscope
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """Put back the default fatal-signal handling that a test module's imports replaced.

    Loading ``libtvm_ffi`` (xgrammar's runtime) installs a SIGSEGV handler that prints a native
    backtrace through the unwinder; a fault inside the unwinder then deadlocks in that handler
    and the worker hangs instead of failing. With the default action (and Python's fault
    handler, where pytest enabled it) a crash ends the worker and is reported."""
    enabled = faulthandler.is_enabled()
    faulthandler.disable()
    signal.signal(signal.SIGSEGV, signal.SIG_DFL)
    if enabled:  # to a copy of the real stderr: a test's output capture replaces fd 2
        faulthandler.enable(file=session.config.stash[_STDERR_FD], all_threads=True)


def _memory_map_count() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's per-process limit), or None off Linux."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f), limit
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after a test module once the process holds half its
    memory-map budget.

    Each XLA:CPU executable keeps a few memory mappings for its code, and jitted library
    functions keep one executable per static configuration for as long as the process lives.
    A test worker runs hundreds of modules; past ``vm.max_map_count`` (65530 by default) every
    mmap fails, so compiles, allocations and C++ exceptions abort or hang the worker."""
    yield
    maps = _memory_map_count()
    if maps is not None and maps[0] > maps[1] // 2:
        import jax

        jax.clear_caches()
        gc.collect()
