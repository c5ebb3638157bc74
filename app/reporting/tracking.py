"""Experiment tracking: a console progress line, `metrics.jsonl` in the run directory, and W&B.

One `Tracker` per run. `log(metrics, iteration)` takes a flat dict of scalar metrics named the
veRL way (`rollout/reward_mean`, `rollout/response_length_mean`, `actor/pg_loss`, `actor/kl`,
`critic/vf_loss`, `timing_s/<call>`, `timing_s/iteration`, `perf/throughput`) and sends it to:

- `<run_dir>/metrics.jsonl`: one JSON object per call, `{"iteration": i, ...metrics}`, flushed
  per line so a crashed run keeps every finished iteration. Non-finite values are written as null.
- the console: a carriage-return progress bar with the key metrics on a terminal, or one plain
  line per iteration when the stream is not a terminal (log files, CI).
- W&B under the same names with step=iteration: offline (files under `<run_dir>/wandb`) unless
  WANDB_API_KEY is set, or whatever WANDB_MODE says when the user set it. `wandb_enabled=False`
  turns it off; if wandb is missing or fails to start, a warning is issued and the run goes on.
  `wandb_id` continues an earlier W&B run (a resumed run: `resume="allow"`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

# Console label -> metric name, in display order; absent metrics are skipped.
DEFAULT_CONSOLE_KEYS: dict[str, str] = {
    "reward": "rollout/reward_mean",
    "len": "rollout/response_length_mean",
    "pg_loss": "actor/pg_loss",
    "kl": "actor/kl",
    "vf_loss": "critic/vf_loss",
    "tok/s": "perf/throughput",
}
BAR_WIDTH = 20


def _to_float(key: str, value: Any) -> float:
    """A metric as a Python float; accepts numbers, bools and 0-d numpy/torch values (`.item()`)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {key!r}: value {value!r} of type {type(value).__name__} is not a scalar number")


def _format_number(value: float) -> str:
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StageTimer:
    """Wall-clock time of named stages of one iteration, as `timing_s/<name>` metrics.

        timer = StageTimer()
        with timer.stage("gen"): ...
        tracker.log({**stats, **timer.metrics()}, iteration)
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:  # repeated stages add up (e.g. several micro-batches of one call)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": value for name, value in self.seconds.items()}


class Tracker:
    """Console + metrics.jsonl + W&B logging for one run (see the module docstring)."""

    def __init__(self, run_dir: str | Path, project: str = "realray", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, total_iterations: int | None = None,
                 wandb_enabled: bool = True, console: bool = True,
                 console_keys: Mapping[str, str] | None = None, stream: TextIO | None = None,
                 wandb_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_iterations = total_iterations
        self.console = console
        self.console_keys = dict(DEFAULT_CONSOLE_KEYS if console_keys is None else console_keys)
        self.stream = stream if stream is not None else sys.stderr
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        self._start_time = time.monotonic()
        self._bar_open = False  # a carriage-return line is on screen without its newline
        self._closed = False
        self.wandb_run: Any = None
        if wandb_enabled:
            self.wandb_run = self._start_wandb(project, run_name or self.run_dir.name, dict(config or {}), wandb_id)

    @property
    def wandb_id(self) -> str | None:
        """The W&B run's id (a resumed run logs into the same W&B run), None without W&B."""
        return None if self.wandb_run is None else str(getattr(self.wandb_run, "id", None) or "") or None

    def _start_wandb(self, project: str, run_name: str, config: dict[str, Any], run_id: str | None) -> Any:
        """A W&B run, or None (with a warning) when wandb is missing or cannot start."""
        try:
            import wandb
        except Exception as exc:  # ImportError, or a broken install raising anything at import
            warnings.warn(f"wandb logging disabled: cannot import wandb ({type(exc).__name__}: {exc})", stacklevel=3)
            return None
        # Passed explicitly, even when the user set WANDB_MODE: wandb reads its environment once per
        # process (its settings singleton), so a later change of WANDB_MODE would otherwise be ignored.
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        try:
            resume = {"id": run_id, "resume": "allow"} if run_id else {}
            return wandb.init(project=project, name=run_name, config=config, dir=str(self.run_dir), mode=mode, **resume)
        except Exception as exc:
            warnings.warn(f"wandb logging disabled: wandb.init failed ({type(exc).__name__}: {exc})", stacklevel=3)
            return None

    def log(self, metrics: Mapping[str, Any], iteration: int) -> None:
        """Record the metrics of one iteration everywhere; `iteration` counts from 0."""
        if self._closed:
            raise RuntimeError("Tracker.log: the tracker is closed")
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        row: dict[str, float | int | None] = {"iteration": iteration}
        row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self.console:
            self._print_progress(values, iteration)
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(values, step=iteration)
            except Exception as exc:
                warnings.warn(f"wandb logging disabled: log failed ({type(exc).__name__}: {exc})", stacklevel=2)
                self.wandb_run = None

    def progress_line(self, values: Mapping[str, float], iteration: int) -> str:
        """`iter 12/40 [#####...] 30% | reward 0.53 | ... | 1.20s/it eta 0:34` (done = iteration + 1)."""
        done = iteration + 1
        elapsed = time.monotonic() - self._start_time
        per_iteration = values.get("timing_s/iteration", elapsed / max(done, 1))
        if self.total_iterations:
            filled = min(BAR_WIDTH, BAR_WIDTH * done // self.total_iterations)
            head = (f"iter {done}/{self.total_iterations} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                    f"{100 * done // self.total_iterations:3d}%")
            eta = f" eta {_format_duration(per_iteration * max(self.total_iterations - done, 0))}"
        else:
            head, eta = f"iter {done}", ""
        shown = [f"{label} {_format_number(values[key])}" for label, key in self.console_keys.items() if key in values]
        return " | ".join([head, *shown, f"{per_iteration:.2f}s/it{eta}"])

    def _print_progress(self, values: Mapping[str, float], iteration: int) -> None:
        line = self.progress_line(values, iteration)
        if self.stream.isatty():
            # \r rewrites the line; \033[K clears what a longer previous line left behind.
            self.stream.write("\r" + line + "\033[K")
            self._bar_open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Finish the W&B run, close metrics.jsonl and end the console line. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar_open:
            self.stream.write("\n")
            self.stream.flush()
        self._jsonl.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as exc:
                warnings.warn(f"wandb finish failed ({type(exc).__name__}: {exc})", stacklevel=2)
            self.wandb_run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of `<run_dir>/metrics.jsonl` (for reports and tests)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["DEFAULT_CONSOLE_KEYS", "StageTimer", "Tracker", "read_metrics"]
