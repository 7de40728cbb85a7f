"""The OpenAI-compatible gateway: SLO classes, admission, routing to workers, request records.

Imports neither torch nor the engine, so the gateway image stays slim.
"""
