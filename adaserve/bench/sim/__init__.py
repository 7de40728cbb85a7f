"""The simulated clock: real models and tokens, time from a device profile (docs/architecture.md §13).

Holds the device cost model and its profiles (device_model.py, device_profiles/), what the start-up
profiler would measure on such a device (profile.py), and the clock that advances by those costs
instead of the wall clock (clock.py).

May import: the engine. The benchmark (``adaserve.bench``) drives it; nothing here imports the bench.
"""
