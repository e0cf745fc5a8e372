"""Training checkpoints: an orbax `CheckpointManager` (keep-N, async) over the whole
`TrainState` (params, optimizer state, step, rng) plus the data iterator's position and
the experiment config, so a restarted run continues bit-identically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class TrainCheckpointer:
    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "config"),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state, data_state: dict[str, Any], config: dict[str, Any]) -> None:
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config),
            ),
        )

    def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
        """Restore into ``abstract_state`` (ShapeDtypeStructs with shardings)."""
        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
