"""The decoding engine: one ``Engine.step()`` admits, prefills, speculates, selects, verifies and commits.

At this level sits the scheduler core: the engine and its iteration (engine.py), the background loop
(loop.py), a request's state (request.py, stop_strings.py), the prefill rule (prefill_chunk.py), several
drafts at once (multi_draft.py), the one config object (config.py) and the assembly from model
directories (build.py). Everything it drives lives in rooms below it:

    model/        the network and one forward of it: layers, attention backends, paged KV cache,
                  the ragged batch layout, token trees, the runner
    loading/      finding, converting and loading checkpoints: catalog, GGUF, safetensors, chat template
    speculation/  drafting, selection, policies, verification and sampling: the paper's algorithms
    cost/         what a forward costs: profiling, the budget B, the cost model and its cache

Arrows run one way: the core imports the rooms; a room never imports the core. Between rooms,
loading -> model, speculation -> model, cost -> model and speculation. Two leaves here, checks.py and
cache_dir.py, import nothing from adaserve and serve every room. tests/test_imports.py checks all of it.
"""
