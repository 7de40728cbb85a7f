"""adaserve: SLO-customized speculative decoding for LLM serving."""

__version__ = "0.1.0"
