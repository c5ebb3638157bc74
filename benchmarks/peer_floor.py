"""The hardware floor of one GRPO step of the peer bench: its least time at the measured ceilings.

Issue 27 asks for the step at most 1.6x "the floor computed from the measured ceilings", printed
in the peer bench's table. The ceilings are a hardware preset's peak_flops and hbm_bw, which for
h200-141g and h100-80g are measured on the lent cards (planning/hardware.py): the H200's bf16
matmul at 785 TFLOP/s and HBM at 4.3 TB/s by default, the H100's 787 TFLOP/s and 2.97 TB/s when
the bench runs there. The step's work, with P the matmul parameters (the LM head
included, the embedding lookup not), R = prompts x group rows, prompt length p, n new tokens:

    prefill   2 P FLOPs per prompt token, plus causal attention (2 s^2 H D L FLOPs a sequence)
    decode    n - 1 steps (the prefill samples the first token); step i is bound by its
              projections, max(streaming the bf16 weights once, 2 R P FLOPs), plus reading the
              cached K/V of every row at context p + i (2 L Hkv D bf16 values per token); the two
              run one after the other, so they add
    reward    a rule on the host: no GPU work
    training  one forward and backward over every token, 3x the forward's FLOPs

The issue's two targets per phase are printed from the same counts (`target_lines`): the training
call's MFU, the FLOPs of one forward and backward with each prompt once (what the engine runs,
but for a group cut at a micro-batch boundary, whose prompt it runs in both: a slight
underestimate) over the call's seconds at the peak; and decode's share of its HBM roofline, the n - 1 steps each streaming the
bf16 weights and reading every row's K/V whole at context p + i (1.06 s on the H200 at the peer
bench's shape, the roofline the issue's decode target has been measured against since its second
step; FP8 rows are set against it too, as the fifteenth step's 61.9% was), over the measured
decode phase.

Two variants: "every row whole" counts each row's prompt in the prefill, in the K/V reads and
in training, as an engine that shares nothing does; "each prompt once" counts a group's prompt
once (this project's shared prompts: one prefill, the cascade decode attention, one copy per
micro-batch in training), the least work the step needs. Both leave out elementwise kernels,
sampling and the optimizer (each a few percent), so they are floors, not estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from planning.hardware import HardwareSpec, hardware_preset
from planning.models import ModelSpec, param_specs

H200 = hardware_preset("h200-141g")
PEAK_FLOPS = H200.peak_flops  # bf16 dense matmul measured on the lent H200, 785 TFLOP/s
HBM_BYTES_PER_S = H200.hbm_bw  # HBM copy rate measured there, 4.3 TB/s
BF16_BYTES = 2


@dataclass(frozen=True)
class StepFloor:
    """Seconds of each phase at the ceilings, and their sum."""

    prefill_s: float
    decode_s: float
    training_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.training_s

    def describe(self) -> str:
        return (f"{self.total_s:.2f} s (prefill {self.prefill_s:.2f}, decode {self.decode_s:.2f}, "
                f"training {self.training_s:.2f})")


def matmul_params(spec: ModelSpec) -> float:
    """P: every matrix a token multiplies, the LM head included (the tied embedding when tied)."""
    total = sum(p.shape[0] * p.shape[1] for p in param_specs(spec)
                if len(p.shape) == 2 and p.name != "model.embed_tokens.weight")
    return float(total + (spec.vocab_size * spec.hidden_size if spec.tie_embeddings else 0))


def step_floor(spec: ModelSpec, prompts: int, group: int, prompt_len: int, gen_len: int,
               prompt_once: bool, hardware: HardwareSpec = H200) -> StepFloor:
    """The floor of one step (module docstring) at `hardware`'s ceilings; `prompt_once` picks the variant."""
    P, rows, p, n = matmul_params(spec), prompts * group, prompt_len, gen_len
    peak_flops, hbm_bw = hardware.peak_flops, hardware.hbm_bw
    hdl = spec.n_heads * spec.head_dim * spec.n_layers  # attention FLOPs per query-key pair / 4
    prompt_copies = prompts if prompt_once else rows
    # Forward FLOPs: the prompts (each copy attends causally within itself), then every row's
    # response tokens, token t attending to p + t keys (4 FLOPs per pair and head dim: QK^T, AV).
    prompt_flops = prompt_copies * (2.0 * P * p + 2.0 * p * p * hdl)
    response_flops = rows * (2.0 * P * n + hdl * (4.0 * n * p + 2.0 * n * n))
    kv_bytes_per_token = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * BF16_BYTES
    weights_s = BF16_BYTES * P / hbm_bw
    projections_s = max(weights_s, 2.0 * rows * P / peak_flops)
    decode_s = 0.0
    for i in range(1, n):  # step i: every row holds p + i cached tokens
        cached = prompt_copies * p + rows * i
        decode_s += projections_s + cached * kv_bytes_per_token / hbm_bw
    return StepFloor(prefill_s=prompt_flops / peak_flops, decode_s=decode_s,
                     training_s=3.0 * (prompt_flops + response_flops) / peak_flops)


def decode_hbm_roofline_s(spec: ModelSpec, rows: int, prompt_len: int, gen_len: int,
                          hardware: HardwareSpec = H200) -> float:
    """Decode's HBM-only time: gen_len - 1 steps, step i streaming the bf16 weights once and
    reading the cached K/V of every row at context prompt_len + i (module docstring)."""
    kv_bytes_per_token = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * BF16_BYTES
    steps = gen_len - 1
    cached = rows * (steps * prompt_len + steps * gen_len / 2)  # sum over i = 1..n-1 of rows * (p + i)
    return (steps * BF16_BYTES * matmul_params(spec) + cached * kv_bytes_per_token) / hardware.hbm_bw


def target_lines(spec: ModelSpec, prompts: int, group: int, prompt_len: int, gen_len: int,
                 measured: dict[str, tuple[float, float]], hardware: HardwareSpec = H200) -> list[str]:
    """One line per system of `measured` ({system: (training call s, decode phase s)}): the
    training call's MFU and decode's share of the HBM roofline (module docstring)."""
    train_flops = step_floor(spec, prompts, group, prompt_len, gen_len, True, hardware).training_s * hardware.peak_flops
    roofline_s = decode_hbm_roofline_s(spec, prompts * group, prompt_len, gen_len, hardware)
    lines = []
    for name, (train_s, decode_s) in measured.items():
        mfu = train_flops / (train_s * hardware.peak_flops)
        lines.append(f"{name}: training call {100 * mfu:.1f}% MFU ({train_flops / 1e15:.2f} PFLOP in {train_s:.2f} s "
                     f"at {hardware.peak_flops / 1e12:.0f} TFLOP/s); decode {100 * roofline_s / decode_s:.1f}% of "
                     f"the HBM roofline ({roofline_s:.2f} s at {hardware.hbm_bw / 1e12:.2f} TB/s, decode {decode_s:.3f} s)")
    return lines


def floor_lines(spec: ModelSpec, prompts: int, group: int, prompt_len: int, gen_len: int,
                steps: dict[str, float], hardware: HardwareSpec = H200) -> list[str]:
    """The table's floor lines at `hardware`'s ceilings: both variants, then each of `steps`
    ({system: s/step}) against them."""
    whole, once = (step_floor(spec, prompts, group, prompt_len, gen_len, v, hardware) for v in (False, True))
    lines = [f"floor at {hardware.peak_flops / 1e12:.0f} TFLOP/s bf16 and {hardware.hbm_bw / 1e12:.2f} TB/s "
             f"({hardware.name}; benchmarks/peer_floor.py): every row whole " + whole.describe() + "; each prompt once "
             + once.describe()]
    lines += [f"{name}: step {seconds:.2f} s = {seconds / whole.total_s:.2f}x / {seconds / once.total_s:.2f}x "
              "the two floors" for name, seconds in steps.items()]
    return lines


__all__ = [
    "H200", "HBM_BYTES_PER_S", "PEAK_FLOPS", "StepFloor", "decode_hbm_roofline_s", "floor_lines", "matmul_params",
    "step_floor", "target_lines",
]
