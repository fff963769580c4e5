"""Orbax checkpoints of a run: model parameters, optimizer state, step and data-iterator state,
saved together (asynchronously) under WORKDIR/checkpoints, the last K kept.

Only complete checkpoints are ever restored (Orbax writes to a temporary folder and renames it
when the save has finished). Restoring takes an abstract target whose leaves may carry shardings
for the devices present now, so a run saved on one mesh resumes on another.
"""

from __future__ import annotations

import json

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
import orbax.checkpoint as ocp



def manager(workdir: Path, keep: int, every: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                           enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=options,
                                 item_names=("state", "data", "meta"))


def saved_steps(workdir: str | Path) -> list[int]:
    """The steps of the complete checkpoints in WORKDIR/checkpoints, in order (none: [])."""
    if not (Path(workdir) / "checkpoints").is_dir():  # (a manager would create the folder)
        return []
    mngr = manager(Path(workdir), 1, 1)
    try:
        return sorted(mngr.all_steps())
    finally:
        mngr.close()


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict,
         force: bool = False) -> bool:
    """Saves (asynchronously) when `step` is on the save interval, or always with `force`.
    The caller may check `mngr.should_save(step)` first to skip building the arguments."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(json.loads(json.dumps(data_state))),
                              meta=ocp.args.JsonSave(meta))
    return mngr.save(step, args=args, force=force)


def restore(mngr: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """(state, data_state, meta) of `step` (default: the latest complete one), or None if the
    directory holds no checkpoint. `abstract_state`: jax.ShapeDtypeStruct leaves (with
    shardings to restore onto a particular mesh)."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                     data=ocp.args.JsonRestore(),
                                                     meta=ocp.args.JsonRestore()))
    return out.state, out.data, out.meta


def restore_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> dict | None:
    """The JSON metadata of `step` (default: the latest) without reading any array."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def place(tree, abstract_tree):
    """`tree`'s arrays moved onto the shardings of `abstract_tree` (same structure)."""
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, abstract_tree)


def restore_params(mngr: ocp.CheckpointManager, abstract_params, step: int | None = None):
    """Only the model parameters of `step` (default: the latest), whatever optimizer the run used;
    None if there is no checkpoint. For evaluation and analysis."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    item = {"params": abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), item)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True)))
    return out.state["params"]


def abstract(tree, sharding=None):
    """ShapeDtypeStructs of `tree`, placed on `sharding` (a Sharding, a tree of them, or None for
    each leaf's current sharding)."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=sharding or getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)
