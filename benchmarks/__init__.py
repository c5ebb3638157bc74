"""GPU benchmark scripts, each run as `python benchmarks/<name>.py` and printing a short table last
(`benchmarks/run_gpu.sh` runs them in one device call; figures go to docs/benchmarks.md).

A package only so that tests can import a script's pieces and run its CPU `--tiny` mode.

Every script can run again with the same arguments. Those that write files (peer_bench,
fidelity_bench, plan_vs_symmetric) write each run into a fresh `<out>/run-NNN/` under their
--out (`<out>/latest` links to the newest; benchmarks/run_dirs.py), print that directory first
and their results files last; the others print only (driver_startup trains in a temporary
directory), or write the one file a flag names (search_bench --plot, realloc_bench --json and
--trace-dir), replacing it.
  run_dirs            the fresh run-NNN directory of each run under --out, and the newest one
  engine_bench        train-step and forward throughput and MFU of the parallel engine
  generate_bench      decode throughput against the memory-bandwidth roofline
  realloc_bench       reallocation between two GPUs against the cost model and the link
  segment_copy_bench  the multi-copy kernel against torch copies
  search_bench        the plan search (CPU): quality, speedup, convergence, evaluations/s
  plan_vs_symmetric   searched against symmetric plans (and async against on-policy), measured
  fidelity_bench      per call, estimated against measured time and peak memory, before and after
                      the run's self-calibration (PPO and GRPO on one GPU)
  peer_setup          the shared inputs of peer_bench: a random HF model with a byte-level BPE, prompts
  peer_reward         the rule reward both systems of peer_bench score with (decoded text)
  peer_trl            TRL's GRPOTrainer on peer_bench's work, timed step by step
  peer_bench          our GRPO against TRL's GRPOTrainer on identical work, one table
"""
