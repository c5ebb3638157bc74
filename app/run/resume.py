"""Exact resume: the run-directory rules, the driver's state in a checkpoint, and the logs' rewind.

A run directory holds one run. `check_run_dir` (before Ray starts) decides where a run starts:
  run.resume unset   the directory must not hold a run yet (metrics.jsonl, plan.json,
                     timeline.jsonl or checkpoints/): reusing it would mix two runs;
  run.resume: auto   the latest complete checkpoint of run.dir (none: start at iteration 0);
  run.resume: PATH   that complete checkpoint; inside run.dir it must be the latest one (a later
                     one would be overwritten by the continuation).
Incomplete checkpoints are never loaded; they are reported and removed (`clear_incomplete`).

`RunState` is what the driver itself holds and a checkpoint must keep for the continuation to
be the run that was interrupted, bit for bit on CPU: iterations done, the data iterator's
position, the KL controller's coefficient (and the coefficients of iterations the driver had
already submitted when it saved: it runs one iteration ahead), the W&B run id, the driver's
random generators, where each trained role's state was saved (its home placement, which the
loader reshards from), and the config fields the continuation must share (`FINGERPRINT`).
The workers' part (weights, optimizer state, random generators) is in the checkpoint's
`state/` directory (actors.worker.state).

`rewind_logs` truncates metrics.jsonl, timeline.jsonl and samples.jsonl to the iterations before
the checkpoint, so a resumed run appends to them without duplicate rows.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.config import ConfigError, ExperimentConfig
from app.run.checkpoint import (
    MARKER,
    RNG_DIR,
    STATE_DIR,
    complete_checkpoints,
    incomplete_checkpoints,
    is_complete,
    iterations_of,
)
from planning.dataflow import Graph
from planning.layout import Layout, Mesh
from planning.plan import ExecutionPlan, Placement

RUN_FILES = ("metrics.jsonl", "plan.json", "timeline.jsonl", "checkpoints")
LOG_FILES = ("metrics.jsonl", "timeline.jsonl", "samples.jsonl")
# Config fields a continuation must share with the run it continues (the data order and the
# models depend on them); anything else (plan, cluster, timeouts, iterations...) may change.
FINGERPRINT = ("algorithm", "models", "batch.prompts", "batch.group_size", "data.path", "data.seed",
               "data.shuffle", "data.toy_size", "data.prompt_key", "run.seed")


def holds_run(run_dir: Path) -> bool:
    return run_dir.is_dir() and any((run_dir / name).exists() for name in RUN_FILES)


def check_run_dir(run_dir: str | Path, resume: str | None) -> Path | None:
    """The checkpoint a run in `run_dir` starts from (None: iteration 0), or a ConfigError naming
    run.dir or run.resume (see the module docstring). Touches nothing."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("run.dir", str(run_dir), "a directory (new, or one this run owns)",
                          problem="names an existing file")
    if resume is None:
        if holds_run(run_dir):
            raise ConfigError("run.dir", str(run_dir), "a fresh directory, or run.resume=auto to continue the run "
                              "it holds", problem="already holds a run (metrics.jsonl / checkpoints)")
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    checkpoint = Path(resume)
    if not checkpoint.is_dir() or not is_complete(checkpoint) or iterations_of(checkpoint) is None:
        raise ConfigError("run.resume", resume, "'auto' or a complete checkpoint directory (…/checkpoints/iter_N "
                          f"holding {MARKER})", problem="not a complete checkpoint")
    inside = checkpoint.resolve().parent.parent == run_dir.resolve()
    if holds_run(run_dir) and not inside:
        raise ConfigError("run.dir", str(run_dir), "a fresh directory for a run continued from another run's "
                          "checkpoint", problem="already holds a run")
    later = [d.name for d in complete_checkpoints(run_dir) if (iterations_of(d) or 0) > (iterations_of(checkpoint) or 0)]
    if inside and later:
        raise ConfigError("run.resume", resume, f"the latest checkpoint of run.dir ({later[-1]}), or run.resume=auto",
                          problem=f"later checkpoints exist ({', '.join(later)})")
    return checkpoint


def clear_incomplete(run_dir: str | Path) -> list[str]:
    """Remove the checkpoint directories a killed writer left; one message per directory."""
    messages = []
    for directory in incomplete_checkpoints(run_dir):
        messages.append(f"checkpoint {directory} is incomplete (a write was cut short): not loaded, removed")
        shutil.rmtree(directory, ignore_errors=True)
    return messages


def rewind_logs(run_dir: str | Path, iterations_done: int) -> None:
    """Keep only the rows of iterations < iterations_done in the logs (LOG_FILES)
    (rewritten to a temporary file and renamed, so a kill leaves the old or the new file)."""
    for name in LOG_FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if isinstance(row, dict) and int(row.get("iteration", -1)) < iterations_done:
                kept.append(line + "\n")
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept), encoding="utf-8")
        os.replace(partial, path)


# ---- the driver's state --------------------------------------------------------------------------


def placement_json(placement: Placement) -> dict[str, Any]:
    mesh = placement.mesh
    return {"start": mesh.start, "size": mesh.size, "gpus_per_node": mesh.gpus_per_node,
            "layout": str(placement.layout)}


def placement_of(record: dict[str, Any]) -> Placement:
    return Placement(Mesh(int(record["start"]), int(record["size"]), int(record["gpus_per_node"])),
                     Layout.parse(str(record["layout"])))


def fingerprint(cfg: ExperimentConfig) -> dict[str, Any]:
    dumped = cfg.model_dump(mode="json")
    out = {}
    for dotted in FINGERPRINT:
        value: Any = dumped
        for part in dotted.split("."):
            value = value[part]
        out[dotted] = value
    return out


def driver_rng_state() -> dict[str, Any]:
    """The driver process's Python, numpy and torch generator states as JSON values."""
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def restore_driver_rng(state: dict[str, Any]) -> None:
    import torch

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


@dataclass(frozen=True)
class RunState:
    """The driver's part of a checkpoint (see the module docstring)."""

    iterations_done: int
    data_epoch: int
    data_position: int
    kl_value: float
    kl_submitted: dict[int, float]
    homes: dict[str, dict[str, Any]]
    fingerprint: dict[str, Any]
    wandb_id: str | None = None
    rng: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["kl_submitted"] = {str(k): v for k, v in self.kl_submitted.items()}
        return out

    @staticmethod
    def from_json(record: dict[str, Any]) -> RunState:
        values = dict(record)
        values["kl_submitted"] = {int(k): float(v) for k, v in values.get("kl_submitted", {}).items()}
        return RunState(**values)


def read_run_state(checkpoint: str | Path) -> RunState:
    """The RunState in a checkpoint's marker; ConfigError (run.resume) when it has none."""
    marker = Path(checkpoint) / MARKER
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        return RunState.from_json(record["run_state"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("run.resume", str(checkpoint), "a checkpoint written with its run state (this version)",
                          problem=f"{marker} holds no readable run state ({type(exc).__name__}: {exc})") from None


def restore_workers(workers: Any, graph: Graph, plan: ExecutionPlan, roles: tuple[str, ...], checkpoint: Path,
                    state: RunState, timeout_s: float) -> dict[str, Placement]:
    """Load each trained role's state (resharded from its saved placement onto its home here)
    and every worker's random generators; move each frozen role to where it is after a whole
    iteration (the first iteration's reallocations of frozen roles, replayed). Returns where
    every role is, as `iteration_ops` expects it at the start of the next iteration."""
    from app.run.schedule import ReallocOp, home_placements, iteration_ops

    homes = home_placements(graph, plan, roles)
    calls = []
    for role in graph.trained_roles:
        if role not in state.homes:
            raise ConfigError("run.resume", str(checkpoint), f"a checkpoint holding the state of {role!r}",
                              problem=f"saved only {sorted(state.homes)}")
        calls.append(workers.call("load_state", role, str(checkpoint / STATE_DIR / role),
                                  placement_of(state.homes[role]), ranks=list(homes[role].mesh.gpus)))
    for call in calls:  # no collectives: the roles load side by side
        workers.get(call, timeout_s)
    workers.run("load_rng_state", str(checkpoint / STATE_DIR / RNG_DIR), timeout_s=timeout_s)
    if state.iterations_done == 0:
        return homes
    ops, after = iteration_ops(graph, plan, roles, homes)
    trained = set(graph.trained_roles)
    for op in ops:
        if isinstance(op, ReallocOp) and op.role not in trained:
            workers.run("reallocate", op.role, op.src, op.dst, ranks=list(op.ranks), timeout_s=timeout_s)
    return after


def check_fingerprint(state: RunState, cfg: ExperimentConfig, checkpoint: Path) -> None:
    """ConfigError naming the first field the continuation does not share with the saved run."""
    now = fingerprint(cfg)
    for dotted in FINGERPRINT:
        if dotted in state.fingerprint and state.fingerprint[dotted] != now[dotted]:
            raise ConfigError(dotted, now[dotted], f"{state.fingerprint[dotted]!r}, the value of the run that "
                              f"wrote {checkpoint} (run.resume continues that run)", problem="differs")


__all__ = [
    "FINGERPRINT", "LOG_FILES", "RUN_FILES", "RunState", "check_fingerprint", "check_run_dir", "clear_incomplete",
    "driver_rng_state", "fingerprint", "holds_run", "placement_json", "placement_of", "read_run_state",
    "restore_driver_rng", "restore_workers", "rewind_logs",
]
