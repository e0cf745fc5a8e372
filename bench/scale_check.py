"""Scale check: every main path of jaxlm on a Qwen3-0.6B-shaped model, on one CPU host.

Builds a randomly initialised ``Qwen3ForCausalLM`` with the published Qwen3-0.6B shape (28
layers, width 1024, 16 query / 8 KV heads of 128, SwiGLU 3072, vocabulary 151936, tied
embeddings, qk-norm, RoPE theta 1e6) in ``transformers``, saves it as bf16 safetensors
(with jaxlm's byte-level tokenizer beside it: the vocabulary matters only for shapes), then
runs each stage in its own subprocess, so each stage's peak RSS is its own and a failing
stage does not stop the others:

    build       transformers builds the model and saves it (skipped when the directory exists)
    load        jaxlm.load_hf(dtype="bfloat16"); every parameter must stay bf16
    generate    jaxlm.generate: 4 prompts x 64 new tokens, greedy (XLA compile time reported)
    sft         2 SFT steps (trainers.step.make_train_step + init_state, AdamW from
                trainers.optim.make_optimizer) with FSDP over 8 forced CPU devices
                (make_mesh(fsdp=8)), batch 8 x 128 tokens, remat="full",
                jaxlm.sharding.VOCAB_SPLIT_RULES (``--remat none --no-vocab-split``: the defaults)
    checkpoint  jaxlm.save_checkpoint + jaxlm.load_checkpoint; the restored parameters must
                equal the saved ones bit for bit
    quant_rtn   quantize_with(model, "rtn", "nvfp4"): NVFP4 W4A4; forward + generate
    quant_wush  quantize_with(model, "wush", "nvfp4", texts): calibrated WUSH W4A4; forward +
                generate
    sft_plan    (only when named) XLA's memory analysis of the SFT step compiled on abstract
                inputs, for LOGICAL_RULES / VOCAB_SPLIT_RULES x remat none / full

Layers are stacked (``scan_layers=True``) unless ``--no-scan-layers``: unrolled, XLA compiles
each of the 28 layers separately (generate: ~190 s instead of ~20 s here). Peak RSS is the
child's ``ru_maxrss`` (``os.wait4``: also for a child that crashed or was killed); it counts
the pages of the memory-mapped safetensors file that ``load_hf`` touched, so the child also
samples its anonymous RSS (``RssAnon``, its own memory). Wall time is the child's, imports and
compilation included. A stage waits (up to ``--max-wait``) until the memory it needs is
available, so it is not started into an OOM. Prints a table and writes ``scale_check.json``
and ``scale_check.md`` under ``--out``::

    python bench/scale_check.py                       # every stage, runs/scale_check/
    python bench/scale_check.py --stages load sft     # some of them
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("build", "load", "generate", "sft", "checkpoint", "quant_rtn", "quant_wush")
#: stages run only when asked for (``--stages sft_plan``)
EXTRA_STAGES = ("sft_plan",)

#: what a stage needs free before it starts (GiB, MemAvailable), so it is not started into an OOM
NEEDS_GB = {"sft_plan": 4, "build": 5, "load": 4, "generate": 5, "sft": 12, "checkpoint": 6, "quant_rtn": 6, "quant_wush": 9}

QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, hidden_act="silu",
    attention_bias=False, use_sliding_window=False,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


# ------------------------------------------------------------------ helpers (children)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class _Timer:
    """Named sub-step timings (seconds) and the peak RSS after each."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = (round(now - self.last, 1), round(_rss_gb(), 2))
        self.last = now
        _log(f"{name}: {self.parts[name][0]:.1f} s (peak RSS so far {self.parts[name][1]:.2f} GB)")

    def summary(self) -> str:
        """``part seconds (peak RSS so far)`` for each part."""
        return ", ".join(f"{k} {t:.0f} s ({m:.1f})" for k, (t, m) in self.parts.items())


def _hf_dir(out: Path) -> Path:
    return out / "hf"


def _load(out: Path, **kw):
    import jaxlm

    return jaxlm.load_hf(_hf_dir(out), dtype="bfloat16", **kw)


def _param_report(model) -> tuple[int, set[str]]:
    """Parameter count and dtypes, from the state's leaves (`flat_params` would slice stacked
    layers into copies)."""
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(int(v.size) for v in leaves), {str(v.dtype) for v in leaves}


# -------------------------------------------------------------------------- stages


def stage_build(out: Path, args) -> dict:
    import torch
    import transformers

    from jaxlm.data.tokenizers import ByteTokenizer, save_tokenizer

    path = _hf_dir(out)
    if (path / "config.json").exists() and (path / "model.safetensors").exists() and not args.rebuild:
        return dict(notes=f"reused {path} (--rebuild to rebuild)")
    timer = _Timer()
    config = transformers.Qwen3Config(**QWEN3_0_6B)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    timer.mark("init")
    model.save_pretrained(path)
    save_tokenizer(ByteTokenizer(), path)
    timer.mark("save")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
    return dict(notes=f"{n / 1e6:.1f}M params, {size:.2f} GiB safetensors; {timer.summary()}")


def stage_load(out: Path, args) -> dict:
    timer = _Timer()
    model = _load(out, scan_layers=args.scan_layers)
    timer.mark("load_hf")
    n, dtypes = _param_report(model)
    if dtypes != {"bfloat16"}:
        raise AssertionError(f"load_hf(dtype='bfloat16') gave parameters in {sorted(dtypes)}")
    return dict(notes=f"{n / 1e6:.1f}M params, all bfloat16; {timer.summary()}")


def stage_generate(out: Path, args) -> dict:
    import jax
    import numpy as np

    import jaxlm

    timer = _Timer()
    model = _load(out, scan_layers=args.scan_layers)
    timer.mark("load")
    compile_s = _compile_seconds()
    res = jaxlm.generate(model, PROMPTS, max_new_tokens=64, temperature=0.0, stop_tokens=())
    jax.block_until_ready(res.tokens)
    timer.mark("generate")
    produced = int(np.asarray(res.lengths).sum())
    if produced != 4 * 64:
        raise AssertionError(f"expected 4 x 64 new tokens, got {produced}")
    compiled = compile_s()
    run = timer.parts["generate"][0] - compiled
    return dict(notes=(f"4 x 64 tokens greedy, scan_layers={args.scan_layers}; XLA compile {compiled:.0f} s, "
                       f"the rest {run:.0f} s ({64 / run:.2f} steps/s); {timer.summary()}"))


def _compile_seconds():
    """A function returning the seconds XLA spent compiling since this call."""
    import jax

    total = [0.0]

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    return lambda: total[0]


def stage_sft(out: Path, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlm.sharding import LOGICAL_RULES, VOCAB_SPLIT_RULES, batch_sharding, make_mesh
    from trainers.config import OptimizerConfig
    from trainers.optim import make_optimizer
    from trainers.step import init_state, make_train_step

    if jax.device_count() != 8:
        raise RuntimeError(f"expected 8 forced CPU devices, got {jax.device_count()}")
    timer = _Timer()
    mesh = make_mesh(data=1, fsdp=8)
    rules = VOCAB_SPLIT_RULES if args.vocab_split else LOGICAL_RULES
    model = _load(out, mesh=mesh, rules=rules, scan_layers=args.scan_layers, remat=args.remat)
    timer.mark("load_hf onto the mesh")
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    del model, state
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-5, warmup_steps=0, schedule="constant"), total_steps=2)
    state = init_state(params, tx, seed=0)
    del params
    jax.block_until_ready(state)
    timer.mark("init_state")
    opt_leaves = jax.tree.leaves(state.opt_state)
    opt_gb = sum(x.nbytes for x in opt_leaves) / 2**30
    opt_dtypes = sorted({str(x.dtype) for x in opt_leaves if x.ndim > 0})
    big = [x for x in [state.params["embed"]] + opt_leaves if x.shape == state.params["embed"].shape]
    if len(big) != 3 or any(len(x.sharding.device_set) != 8 or x.sharding.is_fully_replicated for x in big):
        raise AssertionError(f"the embedding or its Adam moments are not split over the mesh: {[x.sharding for x in big]}")

    B, T = args.batch, args.seq_len
    rng = np.random.default_rng(0)
    batch = dict(
        tokens=rng.integers(3, 259, (B, T), dtype=np.int32),
        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        segment_ids=np.ones((B, T), np.int32),
        loss_mask=np.ones((B, T), bool),
    )
    batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, batch_sharding(mesh))
    step = make_train_step(graphdef, tx, schedule)
    losses = []
    for i in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if not bool(metrics["finite"]):
            raise AssertionError(f"step {i}: non-finite loss or gradient ({metrics})")
        timer.mark(f"step {i + 1}" + (" (compile)" if i == 0 else ""))
    return dict(
        notes=(f"fsdp=8, batch {B}x{T}, scan_layers={args.scan_layers}, remat={args.remat}, "
               f"{'VOCAB_SPLIT_RULES' if args.vocab_split else 'LOGICAL_RULES'}; loss "
               f"{losses[0]:.3f} -> {losses[1]:.3f}; AdamW state {opt_gb:.2f} GiB {opt_dtypes}; {timer.summary()}"),
        losses=losses,
    )


def stage_sft_plan(out: Path, args) -> dict:
    """XLA's memory analysis of the SFT step, compiled on abstract inputs (no weights) on the
    8-device mesh, for LOGICAL_RULES / VOCAB_SPLIT_RULES x remat none / full."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxlm
    from jaxlm.models.transformer import abstract_model
    from jaxlm.sharding import LOGICAL_RULES, VOCAB_SPLIT_RULES, batch_sharding, make_mesh, model_shardings
    from trainers.config import OptimizerConfig
    from trainers.optim import make_optimizer
    from trainers.step import TrainState, make_train_step

    mesh = make_mesh(data=1, fsdp=8)
    home = NamedSharding(mesh, PartitionSpec())
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-5, warmup_steps=0, schedule="constant"), total_steps=2)
    B, T = args.batch, args.seq_len
    bs = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((B, T), bool if k == "loss_mask" else jnp.int32, sharding=bs)
             for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    rows = []
    for rules_name, rules in (("LOGICAL_RULES", LOGICAL_RULES), ("VOCAB_SPLIT_RULES", VOCAB_SPLIT_RULES)):
        for remat in ("none", "full"):
            cfg = jaxlm.ModelConfig.qwen3_0_6b(dtype="bfloat16", param_dtype="bfloat16", scan_layers=args.scan_layers,
                                               remat=remat)
            model = abstract_model(cfg)
            graphdef, abstract = nnx.split(model)
            sh = nnx.to_pure_dict(model_shardings(model, mesh, rules))
            sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
            params = jax.tree.map(sds, nnx.to_pure_dict(abstract), sh)
            shapes = jax.eval_shape(tx.init, params)
            opt_sh = optax.tree_map_params(tx, lambda _, s: s, shapes, sh, transform_non_params=lambda _: home)
            state = TrainState(params=params, opt_state=jax.tree.map(sds, shapes, opt_sh),
                               step=jax.ShapeDtypeStruct((), jnp.int32, sharding=home),
                               rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=home))
            step = make_train_step(graphdef, tx, schedule).step
            t0 = time.perf_counter()
            mem = jax.jit(step, donate_argnums=(0,)).lower(state, batch).compile().memory_analysis()
            temp, arg = mem.temp_size_in_bytes / 2**30, mem.argument_size_in_bytes / 2**30
            rows.append(f"{rules_name}, remat={remat}: temp {temp:.2f} + state {arg:.2f} GiB per device "
                        f"(x8 = {8 * (temp + arg):.1f} GiB; compile {time.perf_counter() - t0:.0f} s)")
            _log(rows[-1])
    return dict(notes=f"batch {B}x{T}, scan_layers={args.scan_layers}: " + "; ".join(rows))


def stage_checkpoint(out: Path, args) -> dict:
    import shutil

    import jax
    import numpy as np
    from flax import nnx

    import jaxlm

    timer = _Timer()
    model = _load(out, scan_layers=args.scan_layers)
    timer.mark("load_hf")
    path = out / "ckpt"
    if path.exists():
        shutil.rmtree(path)
    jaxlm.save_checkpoint(model, path)
    timer.mark("save_checkpoint")
    restored = jaxlm.load_checkpoint(path)
    timer.mark("load_checkpoint")
    def leaves(m):
        flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(m, nnx.Param)))[0]
        return {jax.tree_util.keystr(k): v for k, v in flat}

    a, b = leaves(model), leaves(restored)
    if sorted(a) != sorted(b):
        raise AssertionError(f"restored names differ: {sorted(set(a) ^ set(b))[:5]}")
    bad = [k for k in a if a[k].dtype != b[k].dtype or not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))]
    if bad:
        raise AssertionError(f"{len(bad)} restored parameters differ, e.g. {bad[:3]}")
    timer.mark("compare")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30
    return dict(notes=f"{len(a)} arrays bit-identical, {size:.2f} GiB on disk; {timer.summary()}")


def _quant_stage(out: Path, method: str, args) -> dict:
    import jax
    import numpy as np

    import jaxlm
    from jaxlm.quant.apply import quantize_with

    timer = _Timer()
    model = _load(out, scan_layers=args.scan_layers)
    timer.mark("load")
    texts = [f"{p} {i}: the quick brown fox jumps over the lazy dog." for i in range(args.calib // 4) for p in PROMPTS]
    tok = model.tokenizer
    ids = np.asarray([tok.encode(t)[:32] + [0] * max(0, 32 - len(tok.encode(t))) for t in PROMPTS[:2]], np.int32)
    mask = ids > 0
    ref = np.asarray(model(ids, mask=mask).logits)
    timer.mark("reference forward")
    qmodel = quantize_with(model, method, "nvfp4", texts if method == "wush" else ())
    del model
    jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(qmodel)))
    timer.mark("quantize")
    logits = np.asarray(qmodel(ids, mask=mask).logits)
    timer.mark("quantized forward")
    rel = float(np.abs(logits - ref)[mask].max() / (np.ptp(ref[mask]) + 1e-12))
    if not np.isfinite(logits[mask]).all():
        raise AssertionError("quantized logits are not finite")
    res = jaxlm.generate(qmodel, PROMPTS, max_new_tokens=args.quant_new_tokens, temperature=0.0, stop_tokens=())
    jax.block_until_ready(res.tokens)
    timer.mark(f"generate 4x{args.quant_new_tokens}")
    calib = f", {len(texts)} calibration texts" if method == "wush" else ""
    return dict(notes=f"NVFP4 W4A4{calib}; logit error / spread {rel:.3f}; {timer.summary()}")


def stage_quant_rtn(out: Path, args) -> dict:
    return _quant_stage(out, "rtn", args)


def stage_quant_wush(out: Path, args) -> dict:
    return _quant_stage(out, "wush", args)


# --------------------------------------------------------------------------- driver


def _available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _wait_for_memory(need: float, max_wait: float) -> float:
    start = time.time()
    avail = _available_gb()
    while avail < need and time.time() - start < max_wait:
        _log(f"waiting for memory: {avail:.1f} GB available, the stage wants {need} GB")
        time.sleep(20)
        avail = _available_gb()
    return avail


def run_stage(name: str, args) -> dict:
    # numpy's OpenBLAS runs WUSH's thousands of small SVDs (16 x C blocks); with its default
    # threads on a busy 2-core machine each took ~28x longer than on one thread
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", JAX_PLATFORMS="cpu", OPENBLAS_NUM_THREADS="1")
    if name in ("sft", "sft_plan"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    result_file = Path(args.out) / f"stage_{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", name, "--out", str(args.out), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--remat", args.remat, "--calib", str(args.calib),
           "--quant-new-tokens", str(args.quant_new_tokens)]
    cmd += ["--scan-layers" if args.scan_layers else "--no-scan-layers"]
    cmd += ["--vocab-split" if args.vocab_split else "--no-vocab-split"]
    cmd += ["--rebuild"] if args.rebuild else []
    avail = _wait_for_memory(NEEDS_GB[name], args.max_wait)
    _log(f"stage {name} ({avail:.1f} GB available)")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parent.parent)
    timed_out = False
    deadline = start + args.timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline and not timed_out:
            proc.kill()
            timed_out = True
        time.sleep(0.5)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    row = dict(stage=name, wall_s=round(wall, 1), peak_rss_gb=round(usage.ru_maxrss / 2**20, 2),
               available_gb=round(avail, 1))
    if result_file.exists():
        row.update(json.loads(result_file.read_text()))
    elif timed_out:
        row.update(status="timeout", notes=f"killed after {args.timeout:.0f} s")
    else:
        code = proc.returncode
        why = f"killed by signal {-code} (OOM killer?)" if code < 0 else f"exit code {code}"
        row.update(status="FAIL", notes=why)
    return row


class _AnonPeak:
    """Peak anonymous RSS (``RssAnon`` of /proc/self/status, sampled every 50 ms): the
    process's own memory, without the file pages that a memory-mapped safetensors read
    touches (those count in ``ru_maxrss`` but are page cache the kernel can drop)."""

    def __init__(self):
        import threading

        self.peak = 0.0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]) / 2**20)
            time.sleep(0.05)


def child(name: str, args) -> None:
    out = Path(args.out)
    result_file = out / f"stage_{name}.json"
    anon = _AnonPeak()
    try:
        res = globals()[f"stage_{name}"](out, args)
        res["status"] = "ok"
    except Exception as e:  # the driver reports it and runs the next stage
        import traceback

        traceback.print_exc()
        res = dict(status="FAIL", notes=f"{type(e).__name__}: {e}"[:500])
    res["peak_anon_gb"] = round(anon.peak, 2)
    result_file.write_text(json.dumps(res))


def table(rows: list[dict]) -> str:
    lines = ["| stage | status | wall (s) | peak RSS (GB) | peak anon (GB) | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        anon = f"{r['peak_anon_gb']:.2f}" if "peak_anon_gb" in r else "-"
        lines.append(f"| {r['stage']} | {r['status']} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {anon} | {r['notes']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scale_check")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES + EXTRA_STAGES)
    p.add_argument("--batch", type=int, default=8, help="SFT sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="SFT tokens per sequence")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="stacked (scanned) layers for generate, SFT and quantization (compile time independent of depth)")
    p.add_argument("--remat", default="full", choices=("none", "full", "dots"), help="SFT rematerialisation")
    p.add_argument("--vocab-split", action=argparse.BooleanOptionalAction, default=True,
                   help="SFT with jaxlm.sharding.VOCAB_SPLIT_RULES (else LOGICAL_RULES)")
    p.add_argument("--calib", type=int, default=64, help="WUSH calibration texts")
    p.add_argument("--quant-new-tokens", type=int, default=8,
                   help="tokens generated per prompt by the quantized models (W4A4 runs the jnp reference on CPU)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the HF checkpoint even if it exists")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per stage")
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for free memory per stage")
    p.add_argument("--child", choices=STAGES + EXTRA_STAGES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args)
        return 0
    stages = list(args.stages)
    needs_hf = any(n not in ("build", "sft_plan") for n in stages)
    if needs_hf and "build" not in stages and not (_hf_dir(Path(args.out)) / "config.json").exists():
        stages.insert(0, "build")
    rows = []
    for name in stages:
        rows.append(run_stage(name, args))
        r = rows[-1]
        _log(f"{name}: {r['status']}, {r['wall_s']:.1f} s, peak RSS {r['peak_rss_gb']:.2f} GB: {r['notes']}")
    md = table(rows)
    print("\n" + md)
    import platform

    meta = dict(command="python " + " ".join([Path(__file__).relative_to(Path.cwd()).as_posix()
                                              if Path(__file__).is_relative_to(Path.cwd()) else __file__]
                                             + (argv if argv is not None else sys.argv[1:])),
                date=time.strftime("%Y-%m-%d %H:%M"), host=platform.node(), cpus=os.cpu_count(),
                mem_total_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1))
    (Path(args.out) / "scale_check.json").write_text(json.dumps(dict(meta=meta, stages=rows), indent=2))
    (Path(args.out) / "scale_check.md").write_text(f"`{meta['command']}` ({meta['date']})\n\n{md}\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
