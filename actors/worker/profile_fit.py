"""Fitting the cost model's efficiency factors to measured times (`python -m app profile`).

`predicted_seconds` asks the planner's cost model for the same work actors.worker.profiler times
(a train step, an optimizer step, decode steps of two lengths); `fit_efficiency` solves for the
OpEfficiency factors (gemm, optimizer, decode) under which the predictions equal the measurements;
`fit_tp_comm` then solves `tp_comm` from the same forward+backward run with tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from actors.worker.profiler import MIN_EFFICIENCY, EngineTiming, ProfileSettings
from planning.cost import ModelRole, PlanningProblem, call_cost_levels
from planning.dataflow import MFC, BatchShape, Graph
from planning.efficiency import OpEfficiency
from planning.hardware import HardwareSpec
from planning.layout import ClusterSpec, Layout, Mesh
from planning.plan import Placement


def predicted_seconds(hw: HardwareSpec, eff: OpEfficiency, settings: ProfileSettings) -> dict[str, float]:
    """The cost model's seconds for the profiled work on one GPU with layout dp1tp1pp1:
    fwd_bwd_s and optimizer_s of the train batch (one micro-batch), decode_step_s (generation
    of the longer minus the shorter response length, per extra step)."""
    b = settings
    problem, placement = _profile_problem(hw, eff, settings, tp=1)
    parts = _train_parts(problem, placement, settings)
    decode = [call_cost_levels(problem, problem.graph.mfc(f"profile_decode_{n}"), placement)[0].time_s
              for n in b.decode_steps]
    return {
        "fwd_bwd_s": _fwd_bwd_s(parts),
        "optimizer_s": parts["optimizer_s"],
        "decode_step_s": (decode[1] - decode[0]) / (b.decode_steps[1] - b.decode_steps[0]),
    }


def predicted_tp_fwd_bwd_s(hw: HardwareSpec, eff: OpEfficiency, settings: ProfileSettings, tp: int) -> float:
    """The cost model's forward+backward of the train batch with layout tp=`tp` on one node."""
    problem, placement = _profile_problem(hw, eff, settings, tp)
    return _fwd_bwd_s(_train_parts(problem, placement, settings))


def fit_tp_comm(hw: HardwareSpec, eff: OpEfficiency, settings: ProfileSettings, tp: int, measured_s: float) -> float:
    """The `tp_comm` factor under which the predicted tp forward+backward (with `eff`'s other
    factors: gemm and decode fitted at tp=1, comm from the raw collectives) equals `measured_s`:
    it folds in whatever the tp all-reduces cost inside real steps beyond a bare all-reduce
    (launch gaps, ranks waiting for each other)."""
    return solve_efficiency(measured_s, lambda e: predicted_tp_fwd_bwd_s(hw, replace(eff, tp_comm=e), settings, tp))


def _profile_problem(hw: HardwareSpec, eff: OpEfficiency, settings: ProfileSettings,
                     tp: int) -> tuple[PlanningProblem, Placement]:
    b = settings
    train = MFC("profile_train", "actor", "train", ("prompts",), ("trained",),
                BatchShape(b.train_seqs, b.train_seq_len, 0))
    short, long = (MFC(f"profile_decode_{n}", "actor", "generate", ("prompts",), (f"responses_{n}",),
                       BatchShape(b.decode_batch, b.decode_prompt_len, n)) for n in b.decode_steps)
    problem = PlanningProblem(Graph("profile", (train, short, long)), ClusterSpec(1, tp, hw),
                              {"actor": ModelRole(b.model, critic=False)}, eff)
    return problem, Placement(Mesh(0, tp, tp), Layout(tp=tp))


def _train_parts(problem: PlanningProblem, placement: Placement, settings: ProfileSettings) -> dict[str, float]:
    parts = call_cost_levels(problem, problem.graph.mfc("profile_train"), placement)[0].breakdown
    if parts["micro_batches"] != 1:
        raise ValueError(f"train batch {settings.train_seqs} x {settings.train_seq_len}: the cost model splits it "
                         f"into {parts['micro_batches']:.0f} micro-batches; the profile runs one")
    return parts


def _fwd_bwd_s(parts: dict[str, float]) -> float:
    return parts["compute_s"] + parts["elementwise_s"] + parts["kernel_overhead_s"] + parts["tp_comm_s"]


def solve_efficiency(measured_s: float, predict: Callable[[float], float]) -> float:
    """The factor e in [MIN_EFFICIENCY, 1] with predict(e) == measured_s, `predict` decreasing in e
    (bisection on log e). Work faster than predicted at e=1 gives 1; a prediction that does not
    depend on e (another bound dominates) gives 1 too, since the factor then changes nothing."""
    if not measured_s > 0:
        raise ValueError(f"measured_s={measured_s}: a measured time must be positive")
    fastest, slowest = predict(1.0), predict(MIN_EFFICIENCY)
    if measured_s <= fastest or slowest <= fastest:
        return 1.0
    if measured_s >= slowest:
        return MIN_EFFICIENCY
    low, high = MIN_EFFICIENCY, 1.0
    for _ in range(60):
        mid = (low * high) ** 0.5
        if predict(mid) > measured_s:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def fit_efficiency(hw: HardwareSpec, settings: ProfileSettings, timing: EngineTiming, rounds: int = 6) -> OpEfficiency:
    """gemm from forward+backward, optimizer from the Adam step, decode from one decode step.

    gemm and decode are coupled in the cost model (matmuls cannot beat streaming the weights at
    hbm_bw * decode; a small decode step may be compute-bound at peak_flops * gemm), so they are
    solved alternately, each with the other's latest value, for a few rounds (a fixed point).
    """
    def predict(eff: OpEfficiency, key: str) -> float:
        return predicted_seconds(hw, eff, settings)[key]

    optimizer = solve_efficiency(timing.optimizer_s, lambda e: predict(OpEfficiency(optimizer=e), "optimizer_s"))
    step_s = max(timing.decode_step_s(settings.decode_steps), 1e-9)  # noise can make the difference <= 0
    gemm = decode = 1.0
    for _ in range(rounds):  # gemm last: the train prediction then matches exactly (unless clamped)
        decode = solve_efficiency(step_s, lambda e: predict(OpEfficiency(gemm=gemm, decode=e), "decode_step_s"))
        gemm = solve_efficiency(timing.fwd_bwd_s, lambda e: predict(OpEfficiency(gemm=e, decode=decode), "fwd_bwd_s"))
    return OpEfficiency(gemm=gemm, decode=decode, optimizer=optimizer)


__all__ = ["fit_efficiency", "fit_tp_comm", "predicted_seconds", "predicted_tp_fwd_bwd_s", "solve_efficiency"]
