"""The simulated clock: real models and tokens, time from a device profile (docs/architecture.md §13).

Holds the device cost model and its profiles (device_model.py, device_profiles/), what the start-up
profiler would measure on such a device (profile.py), and the clock that advances by those costs
instead of the wall clock (clock.py). The replay clock (replay.py) runs the engine's scheduling on the same
prices with acceptance replayed from recorded draft/target agreement (agreement.py), no model at all: a
360 s trace in seconds to a minute, checked against the real engine by tests/bench/sim/test_replay.py.

May import: the engine. The benchmark (``adaserve.bench``) drives it; nothing here imports the bench.
"""
