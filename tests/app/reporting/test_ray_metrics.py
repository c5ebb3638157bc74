"""The run's metrics as Ray Gauges: the names (unit) and, on the shared local Ray, the names as
the node's Prometheus endpoint serves them (ray tier: Ray reports application metrics every few
seconds, so the test polls the endpoint for up to METRICS_WAIT_S)."""

from __future__ import annotations

import math
import time
import urllib.request

import pytest

from app.reporting.ray_metrics import RayMetricsExporter, gauge_name, gauge_values
from tests.ray_fixtures import ray_session  # noqa: F401  (the shared Ray instance fixture)

METRICS_WAIT_S = 90.0
ITERATION_METRICS = {
    "rollout/reward_mean": 0.625, "actor/kl": 0.0125, "perf/throughput": 1234.5, "actor/pg_loss": -0.5,
    "timing_s/actor_gen": 1.5, "timing_s/actor_train": 2.25, "timing_s/iteration": 4.0,
    "memory/actor_train_peak_gib": 3.5, "critic/vf_loss": math.nan,
}


@pytest.mark.unit
def test_gauge_names_and_values() -> None:
    values = gauge_values(ITERATION_METRICS, 7)
    assert values[("realray_iteration", "")] == 7.0
    assert values[("realray_rollout_reward_mean", "")] == 0.625
    assert values[("realray_actor_kl", "")] == 0.0125
    assert values[("realray_perf_throughput", "")] == 1234.5
    assert values[("realray_memory_actor_train_peak_gib", "")] == 3.5
    # Per-call times are one gauge with the call's name as a tag.
    assert values[("realray_timing_s", "actor_gen")] == 1.5 and values[("realray_timing_s", "iteration")] == 4.0
    assert ("realray_critic_vf_loss", "") not in values  # non-finite values are not exported
    assert gauge_name("rollout/response-length mean") == "realray_rollout_response_length_mean"


def node_metrics_text() -> str:
    """What Prometheus scrapes from this Ray node: its metrics export port's /metrics page."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.mark.ray
def test_driver_gauges_reach_the_node_metrics_endpoint(ray_session: None) -> None:  # noqa: F811
    exporter = RayMetricsExporter("metrics-test-run")
    expected = ['ray_realray_rollout_reward_mean{', 'ray_realray_actor_kl{', 'ray_realray_perf_throughput{',
                'ray_realray_iteration{', 'name="actor_gen"', 'name="actor_train"', 'run="metrics-test-run"']
    deadline = time.monotonic() + METRICS_WAIT_S
    text = ""
    while time.monotonic() < deadline:
        exporter.export(ITERATION_METRICS, 3)  # gauges are re-set, as every iteration does
        text = node_metrics_text()
        if all(name in text for name in expected):
            break
        time.sleep(2.0)
    # This run's lines (other runs of the test session, e.g. drivers' runs, export their own).
    ours = [line for line in text.splitlines() if 'run="metrics-test-run"' in line and not line.startswith("#")]
    missing = [name for name in expected if name not in text]
    assert not missing, f"not on the metrics endpoint after {METRICS_WAIT_S:g} s: {missing}; ours: {ours[:10]}"
    reward = next(line for line in ours if line.startswith("ray_realray_rollout_reward_mean{"))
    assert float(reward.rsplit(" ", 1)[1]) == pytest.approx(0.625)
    timing = next(line for line in ours if line.startswith("ray_realray_timing_s{") and 'name="actor_train"' in line)
    assert float(timing.rsplit(" ", 1)[1]) == pytest.approx(2.25)
    assert exporter.enabled
