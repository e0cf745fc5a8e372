"""The editing comparison on the synthetic fact world (docs/editing.md).

    python bench/editing.py              # trains configs/facts.py once (runs/facts), then edits

Runs CrispEdit, fine-tuning, AlphaEdit and MEMIT on the same 100 counterfactual requests,
once as one batch and once as 4 sequential batches of 25, through `jaxlm edit`; then the
CrispEdit variants that project Adam's step instead of the gradient (``project=update``)
and a higher energy threshold.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxlm.data.facts import FactWorld, write_requests  # noqa: E402
from trainers.cli import main as jaxlm_main  # noqa: E402
from trainers.recipes import load_config  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/facts")
    ap.add_argument("--edits", type=int, default=100)
    a = ap.parse_args()
    run = Path(a.run)
    if not (run / "model").exists():
        jaxlm_main(["train", "facts", f"trainer.out_dir={run}", "trainer.progress=false"])
    world = load_config("facts").data.source
    assert isinstance(world, FactWorld)
    requests = write_requests(world.edit_requests(a.edits, seed=0), run / "requests.jsonl")
    runs = [("all", 1, []), ("all", 4, []), ("crispedit", 1, ["--gradient.project", "update"]),
            ("crispedit", 4, ["--gradient.project", "update"]),
            ("crispedit", 4, ["--gradient.project", "update", "--gradient.energy", "0.9"])]
    for i, (method, batches, extra) in enumerate(runs):
        print(f"\n## {a.edits} edits, {batches} sequential batch(es) {' '.join(extra)}")
        jaxlm_main(["edit", str(run / "model"), "--requests", str(requests), "--method", method,
                    "--batches", str(batches), "--report", str(run / f"edit_report_{i}.json"), *extra])
