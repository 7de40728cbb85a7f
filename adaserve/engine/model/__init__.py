"""The network and one forward of it: what the engine runs on a device.

Holds the model's shape from ``config.json`` (config.py), the Llama-family layers (layers.py, rope.py,
few_rows.py), the attention backends (attention/), the paged KV cache (kv_cache.py) and the index of its
cached prefixes (prefix_cache.py), token trees (tree.py: every forward's segments are trees, chains
included), the ragged batch layout (batch.py), and the runner that does one forward over many requests
(runner.py).

May import: torch, numpy, and the engine's leaves (checks.py, cache_dir.py). Nothing else of the engine:
the scheduler, speculation and cost all build on this room.
"""
