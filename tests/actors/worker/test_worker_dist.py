"""ModelWorker end to end without Ray: PPO iterations over 2 gloo ranks with a different layout
per call (reallocations in between) must give the numbers of the same iterations on one worker.

Plan of the parallel run (2 GPUs of one node):
  actor   home/train dp2      -> actor_gen tp2 (reallocated, released after generation)
  ref     pp2 (its only copy); in odd iterations it moves to GPU 0 alone for its call and back
  critic  home/train on GPU 1 alone -> critic_inf tp2 (reallocated, released; rank 0 never
          loaded the critic and learns its shapes inside the reallocation)
  rew_inf rule-based reward (toy task), dp2
After the first iteration the parallel run moves the trained models' homes, as a re-plan does
(`ModelWorker.rehome`: weights and ZeRO-1 optimizer state): the actor from dp2 to tp2 (then its
generation needs no reallocation), the critic from GPU 1 to GPU 0. Training must go on as if
nothing moved. The serial reference runs every call on GPU 0 with layout dp1tp1pp1. Data moves
between ranks with all_gather_object, standing in for Ray's object store.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from actors.worker import CallSpec, ModelWorker, placement_group_sets
from planning.layout import Layout, Mesh
from planning.models import ModelSpec
from planning.plan import Placement
from planning.realloc_plan import plan_reallocation
from tests.dist_harness import run_distributed

SPEC = ModelSpec("worker-test", "llama", vocab_size=256, hidden_size=32, intermediate_size=64, n_layers=2,
                 n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
N_PROMPTS = 8
ITERATIONS = 2
OPTIM = {"lr": 5e-3, "max_grad_norm": 1.0}
PPO = {"kl_coef": 0.05, "gamma": 1.0, "lam": 0.95, "clip_eps": 0.2, "value_clip": 0.2, "ppo_minibatches": 2,
       "ppo_epochs": 2, "entropy_coef": 0.01, "seed": 3, "temperature": 1.0}
GEN = {"max_new_tokens": 5, "temperature": 1.0, "seed": 11, "tokenizer": "app.data.toy_task:CharTokenizer"}
ROLES = {"actor": (False, True, 0), "ref": (False, False, 1), "critic": (True, True, 2)}  # critic, trainable, seed


def placements(parallel: bool) -> dict[str, Placement]:
    if not parallel:
        single = Placement(Mesh(0, 1, 2), Layout())
        return {name: single for name in ("actor_home", "actor_gen", "ref", "ref_alt", "critic_home", "critic_inf",
                                          "rew_inf")}
    both = Mesh(0, 2, 2)
    return {
        "actor_home": Placement(both, Layout(dp=2)),
        "actor_gen": Placement(both, Layout(tp=2)),
        "ref": Placement(both, Layout(pp=2)),
        "ref_alt": Placement(Mesh(0, 1, 2), Layout()),
        "critic_home": Placement(Mesh(1, 1, 2), Layout()),
        "critic_inf": Placement(both, Layout(tp=2)),
        "rew_inf": Placement(both, Layout(dp=2)),
    }


# Where the parallel run's trained models live from the second iteration on (a re-plan's move).
NEW_HOMES = {"actor_home": Placement(Mesh(0, 2, 2), Layout(tp=2)), "critic_home": Placement(Mesh(0, 1, 2), Layout())}


def prompt_shard() -> dict[str, Any]:
    from app.data.toy_task import CharTokenizer, generate_toy_prompts

    records = generate_toy_prompts(N_PROMPTS, seed=5)
    tok = CharTokenizer()
    return {"row_start": 0, "n": N_PROMPTS, "prompt": [r["prompt"] for r in records],
            "answer": [r["answer"] for r in records],
            "prompt_ids": [torch.tensor(tok.encode_prompt(r["prompt"])) for r in records]}


class MiniDriver:
    """Stands in for app.run.driver: the same calls, in the same order, on every rank."""

    def __init__(self, worker: ModelWorker, places: dict[str, Placement], world: int) -> None:
        self.worker, self.places, self.world = worker, places, world

    def exchange(self, item: dict | None) -> list[dict]:
        """Every rank's non-None item (data shards, or the metadata of a call's ranks)."""
        if self.world == 1:
            return [item] if item is not None else []
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, item)
        return [d for d in gathered if d is not None]

    def call(self, name: str, role: str, kind: str, place: str, it: int, params: dict, inputs: list[dict]) -> tuple[dict | None, list[dict]]:
        placement = self.places[place]
        meta, data = None, None
        if self.worker.rank in placement.mesh.gpus:
            spec = CallSpec(name, role, kind, placement, it, N_PROMPTS, params)
            meta, data = self.worker.run_call(spec, *inputs)
        return self.exchange(meta)[0], self.exchange(data)

    def move(self, role: str, src: str, dst: str) -> None:
        a, b = self.places[src], self.places[dst]
        if a != b and self.worker.rank in set(a.mesh.gpus) | set(b.mesh.gpus):
            self.worker.reallocate(role, a, b)

    def release(self, role: str, src: str, dst: str) -> None:
        a, b = self.places[src], self.places[dst]
        if a != b and self.worker.rank in b.mesh.gpus:
            self.worker.release(role, b)

    def iteration(self, it: int, prompts: dict) -> dict[str, Any]:
        self.move("actor", "actor_home", "actor_gen")
        _, gen = self.call("actor_gen", "actor", "generate", "actor_gen", it, GEN, [prompts])
        self.release("actor", "actor_home", "actor_gen")
        rew_params = {"reward_fn": "app.data.toy_task:toy_reward", "tokenizer": GEN["tokenizer"]}
        _, rew = self.call("rew_inf", "reward", "inference", "rew_inf", it, rew_params, gen)
        ref_place = "ref_alt" if it % 2 else "ref"  # odd iterations: the frozen ref moves away and back
        self.move("ref", "ref", ref_place)
        _, ref = self.call("ref_inf", "ref", "inference", ref_place, it, {"temperature": 1.0}, gen)
        self.move("ref", ref_place, "ref")
        self.move("critic", "critic_home", "critic_inf")
        _, values = self.call("critic_inf", "critic", "inference", "critic_inf", it, {}, gen)
        self.release("critic", "critic_home", "critic_inf")
        inputs = gen + rew + ref + values
        actor_meta, _ = self.call("actor_train", "actor", "train", "actor_home", it, PPO, inputs)
        critic_meta, _ = self.call("critic_train", "critic", "train", "critic_home", it, PPO, inputs)
        rows = sorted((r for shard in gen for r in zip(range(shard["row_start"], shard["row_start"] + shard["n"]),
                                                           shard["response_ids"])), key=lambda x: x[0])
        rewards = sorted((r for shard in rew for r in zip(range(shard["row_start"], shard["row_start"] + shard["n"]),
                                                          shard["rewards"])), key=lambda x: x[0])
        return {"actor": actor_meta, "critic": critic_meta, "responses": [r[1].tolist() for r in rows],
                "rewards": [r[1] for r in rewards]}


def setup_worker(worker: ModelWorker, places: dict[str, Placement]) -> None:
    sets: list[tuple[int, ...]] = []
    for placement in places.values():
        sets += placement_group_sets(placement)
    moves = [("actor", places["actor_home"], places["actor_gen"]), ("critic", places["critic_home"], places["critic_inf"]),
             ("ref", places["ref"], places["ref_alt"]), ("ref", places["ref_alt"], places["ref"])]
    if places["actor_home"].mesh.size > 1:  # the parallel run: its homes move after iteration 0
        moves += [("actor", places["actor_home"], NEW_HOMES["actor_home"]),
                  ("critic", places["critic_home"], NEW_HOMES["critic_home"]),
                  ("critic", NEW_HOMES["critic_home"], places["critic_inf"])]
    for role, src, dst in moves:
        if src != dst:
            sets += list(plan_reallocation(SPEC, role == "critic", src, dst).groups)
            sets.append(tuple(sorted(set(src.mesh.gpus) | set(dst.mesh.gpus))))
    if dist.get_world_size() > 1 and places["actor_home"].mesh.size > 1:
        worker.ensure_groups(sets)
    for role, (critic, trainable, seed) in ROLES.items():
        home = places["ref" if role == "ref" else f"{role}_home"]
        if worker.rank not in home.mesh.gpus:
            continue  # as the driver does: a rank outside the home mesh learns the shapes on reallocation
        worker.load_model(role, SPEC, critic, home, None, seed, trainable, OPTIM if trainable else {})


def run_ppo(worker: ModelWorker, places: dict[str, Placement], world: int, out: Path) -> dict[str, Any] | None:
    setup_worker(worker, places)
    driver = MiniDriver(worker, places, world)
    for role in ("actor", "critic"):
        if worker.rank in places[f"{role}_home"].mesh.gpus:
            worker.export(role, str(out / f"{role}-init"))
    results = []
    for it in range(ITERATIONS):
        results.append(driver.iteration(it, prompt_shard()))
        if it == 0 and places["actor_home"].mesh.size > 1:
            rehome(worker, places)
    for role in ("actor", "critic"):
        if worker.rank in places[f"{role}_home"].mesh.gpus:
            worker.export(role, str(out / f"{role}-final"))
    return {"iterations": results} if worker.rank == 0 else None


def rehome(worker: ModelWorker, places: dict[str, Placement]) -> None:
    """Move both trained models to NEW_HOMES (in place in `places`), on the ranks of both meshes."""
    for role in ("actor", "critic"):
        key = f"{role}_home"
        src, dst = places[key], NEW_HOMES[key]
        if worker.rank in set(src.mesh.gpus) | set(dst.mesh.gpus):
            stats = worker.rehome(role, src, dst)
            assert stats["bytes_sent"] + stats["bytes_received"] + stats["local_bytes"] > 0, stats
        places[key] = dst


def _ppo_ranks(rank: int, world_size: int, tmp: str) -> dict[str, Any] | None:
    torch.manual_seed(0)
    parallel = run_ppo(ModelWorker(rank, world_size, "cpu"), placements(True), world_size, Path(tmp) / "parallel")
    dist.barrier()
    serial = None
    if rank == 0:
        serial = run_ppo(ModelWorker(0, 1, "cpu"), placements(False), 1, Path(tmp) / "serial")
    dist.barrier()
    return {"parallel": parallel, "serial": serial} if rank == 0 else None


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _assert_metrics_close(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    numeric = [k for k, v in b.items() if "/" in k and isinstance(v, float)]
    assert numeric, f"{what}: no metrics"
    for key in numeric:
        if key == "critic/vf_clipfrac":
            # Counts tokens whose clipped value loss exceeds the unclipped one. In the first step
            # the predictions equal the old values up to rounding (computed under another layout
            # in the parallel run, the same one serially), so the count is rounding noise there.
            assert 0.0 <= a[key] <= 1.0
            continue
        # A token at the clip boundary may flip with rounding: allow ~2 of ~40.
        tol = 0.06 if "clipfrac" in key else 2e-5
        assert math.isclose(a[key], b[key], rel_tol=2e-3, abs_tol=tol), f"{what} {key}: {a[key]} vs serial {b[key]}"


@pytest.mark.dist
def test_ppo_iterations_match_serial_and_train(tmp_path: Path) -> None:
    rank0, _ = run_distributed(_ppo_ranks, 2, str(tmp_path), timeout_s=600.0)
    parallel, serial = rank0["parallel"]["iterations"], rank0["serial"]["iterations"]
    for it, (par, ser) in enumerate(zip(parallel, serial)):
        assert par["responses"] == ser["responses"], f"iteration {it}: generated tokens differ"
        assert par["rewards"] == pytest.approx(ser["rewards"])
        _assert_metrics_close(par["actor"], ser["actor"], f"iteration {it} actor")
        _assert_metrics_close(par["critic"], ser["critic"], f"iteration {it} critic")
        for key in ("actor/pg_loss", "actor/kl", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr",
                    "rollout/reward_mean", "rollout/response_length_mean"):
            assert key in par["actor"], f"actor metrics lack {key}"
        for key in ("critic/vf_loss", "critic/vf_clipfrac"):
            assert key in par["critic"], f"critic metrics lack {key}"
    # KL to the (differently initialised) ref is positive, and the actor's second rollout
    # comes from updated weights.
    assert parallel[0]["actor"]["actor/kl"] != 0.0
    for role in ("actor", "critic"):
        init = _load(tmp_path / "parallel" / f"{role}-init")
        final_par = _load(tmp_path / "parallel" / f"{role}-final")
        final_ser = _load(tmp_path / "serial" / f"{role}-final")
        assert set(final_par) == set(final_ser) == set(init)
        changed = max(float((final_par[k] - init[k]).abs().max()) for k in init)
        assert changed > 1e-3, f"{role}: training left the weights unchanged (max change {changed})"
        for name in init:
            torch.testing.assert_close(final_par[name], final_ser[name], rtol=1e-3, atol=2e-5,
                                       msg=lambda m, n=name, r=role: f"{r} {n}: {m}")


# ---- the same run on GPUs: NCCL, bf16 weights, CUDA-graph decoding --------------------------------


def _nccl_rank(rank: int, world_size: int, port: int, tmp: str, results: Any) -> None:
    import traceback

    try:
        worker = ModelWorker(rank, world_size, f"cuda:{rank}")
        worker.init_distributed("127.0.0.1", port, "nccl", 120.0)
        out = run_ppo(worker, placements(True), world_size, Path(tmp))
        dist.barrier()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.gpu
def test_ppo_iterations_on_two_gpus(tmp_path: Path) -> None:
    import multiprocessing as mp

    from actors.engine.process_groups import free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, str(tmp_path), results)) for r in range(2)]
    for proc in procs:
        proc.start()
    outcome = dict((rank, (ok, value)) for rank, ok, value in (results.get(timeout=300) for _ in procs))
    for proc in procs:
        proc.join(timeout=30)
    failures = {rank: value for rank, (ok, value) in outcome.items() if not ok}
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
    iterations = outcome[0][1]["iterations"]
    for it in iterations:
        for key in ("actor/pg_loss", "actor/grad_norm", "rollout/reward_mean"):
            assert math.isfinite(it["actor"][key]), f"{key} = {it['actor'][key]}"
        assert math.isfinite(it["critic"]["critic/vf_loss"])
    for role in ("actor", "critic"):
        init, final = _load(tmp_path / f"{role}-init"), _load(tmp_path / f"{role}-final")
        assert max(float((final[k].float() - init[k].float()).abs().max()) for k in init) > 1e-3
