"""Training the models the project ships, offline on CPU.

Holds the demo target/draft pair's trainer (train_demo.py, ``models/demo``) and the distillation of a
small draft for SmolLM2-135M-Instruct from the target's own greedy answers (train_draft.py,
``models/smollm2-draft``). Each module's docstring has its command (``python -m adaserve.training.X``).

May import: the engine, and ``adaserve.bench.workload`` for the prompt sources the benchmark also uses.
"""
