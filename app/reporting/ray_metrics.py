"""The run's metrics as Ray application metrics, where the cluster's Prometheus and Grafana look.

Ray exports metrics made with `ray.util.metrics` in any process of the cluster, the driver
included, through the node's metrics agent on the node's metrics export port (`ray start
--metrics-export-port`, `ray.nodes()[i]["MetricsExportPort"]`; Ray's Prometheus service discovery
file under the session directory lists it), with the prefix `ray_`. `RayMetricsExporter.export`
turns one iteration's metrics (the names of `metrics.jsonl`) into Gauges:

  realray_iteration                  the last finished iteration (counting from 0)
  realray_timing_s{name=<x>}         `timing_s/<x>`: per call (actor_gen, ref_inf, actor_train, ...),
                                     `iteration` and `realloc`, in seconds
  realray_<group>_<name>             every other metric, `/` and other signs as `_`:
                                     rollout/reward_mean -> realray_rollout_reward_mean,
                                     actor/kl -> realray_actor_kl, perf/throughput -> realray_perf_throughput,
                                     memory/<call>_peak_gib -> realray_memory_<call>_peak_gib (when workers report it)

so Prometheus shows e.g. `ray_realray_rollout_reward_mean{run="grpo-gsm8k-20261201-101500"}`. Every
gauge carries the tag `run` (the run directory's name); non-finite values are skipped. Ray is
imported when an exporter is made, so this module costs nothing to `python -m app plan`.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

PREFIX = "realray_"
TIMING_GROUP = "timing_s/"
ITERATION_GAUGE = PREFIX + "iteration"
TIMING_GAUGE = PREFIX + "timing_s"
_NOT_IN_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def gauge_name(metric: str) -> str:
    """The Prometheus-safe gauge name of a non-timing metric: `actor/pg_loss` -> `realray_actor_pg_loss`."""
    return PREFIX + _NOT_IN_A_NAME.sub("_", metric)


def gauge_values(metrics: Mapping[str, float], iteration: int) -> dict[tuple[str, str], float]:
    """(gauge name, `name` tag or "") -> value for one iteration, as `export` sets them."""
    values: dict[tuple[str, str], float] = {(ITERATION_GAUGE, ""): float(iteration)}
    for key, value in metrics.items():
        value = float(value)
        if not math.isfinite(value):
            continue
        if key.startswith(TIMING_GROUP):
            values[(TIMING_GAUGE, key.removeprefix(TIMING_GROUP))] = value
        else:
            values[(gauge_name(key), "")] = value
    return values


class RayMetricsExporter:
    """Gauges of one run, created as metric names first appear. Needs an initialised Ray."""

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Gauge  # Ray is only needed once a run exports

        self._gauge_cls = Gauge
        self.run_name = run_name
        self._gauges: dict[str, Any] = {}
        self.enabled = True

    def _gauge(self, name: str, timing: bool) -> Any:
        if name not in self._gauges:
            description = ("seconds of a model function call, the iteration or the reallocations (tag name)"
                           if timing else f"realray metric {name.removeprefix(PREFIX)}")
            tag_keys = ("run", "name") if timing else ("run",)
            gauge = self._gauge_cls(name, description=description, tag_keys=tag_keys)
            gauge.set_default_tags({"run": self.run_name})
            self._gauges[name] = gauge
        return self._gauges[name]

    def export(self, metrics: Mapping[str, float], iteration: int) -> None:
        """Set every gauge of this iteration; on a Ray error warn once and stop exporting
        (metrics.jsonl and W&B keep everything: these gauges are a view for dashboards)."""
        if not self.enabled:
            return
        try:
            for (name, tag), value in gauge_values(metrics, iteration).items():
                gauge = self._gauge(name, timing=name == TIMING_GAUGE)
                gauge.set(value, tags={"name": tag} if tag else None)
        except Exception as exc:  # a Ray metrics failure must never end a training run
            warnings.warn(f"Ray metrics export disabled: {type(exc).__name__}: {exc}", stacklevel=2)
            self.enabled = False


__all__ = ["ITERATION_GAUGE", "PREFIX", "TIMING_GAUGE", "RayMetricsExporter", "gauge_name", "gauge_values"]
