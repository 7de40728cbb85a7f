"""What the worker, the gateway and the operator agree on, kept where none of them has to import another.

- ``slo``: SLO class names, finish reasons, and the one rule for whether a request met its SLO.
- ``generate``: the body of a worker's ``POST /v1/generate`` (what the gateway sends) and its id syntax.
- ``registration``: the document a worker publishes about itself (its Redis entry, ``GET /v1/status``).
- ``registry``: where those documents live in Redis, and the one function that reads the live ones.
- ``redis_settings``: the Redis URL and key prefix every service is configured with.

Only the standard library and pydantic are imported here: never torch, numpy, a Redis driver or the
engine, so the slim gateway and operator images load it as it is (tests/test_imports.py checks).
"""
