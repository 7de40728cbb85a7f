"""The benchmark: workloads, the side-by-side run of every policy, load over HTTP (docs/benchmarks.md).

Holds the request schedules (workload.py, and the AdaServe artifact's trace files, emission_trace.py),
the in-process side-by-side benchmark (runner.py) with the systems it names (presets.py: vllm, sarathi,
vllm-spec:K, the paper's adaserve and our variants), its metrics and reports (metrics.py, budget_use.py,
draft_report.py, selection_gap.py), the Hugging Face peer (hf_peer.py, peer_compare.py), the engine-only
micro-benchmarks (engine_only.py, model_costs.py, microbench_options.py), greedy speculation against plain
decoding on a batch (lossless_batch.py: CI's batched lossless test and scripts/lossless-batch.py), multi-turn chat
with and without prefix caching (prefix_reuse.py, over workload.py's conversations), and load through the gateway
(loadgen.py), and the paper's figures on the replay clock (replay_sweep.py: traces x systems x seeds in
parallel processes). The simulated and replay clocks are their own room, ``bench/sim/``; training the shipped
models is ``adaserve.training``.

May import: the engine and ``adaserve.plots``. Nothing but the CLI, the scripts, the training scripts and the tests
imports it.
"""
