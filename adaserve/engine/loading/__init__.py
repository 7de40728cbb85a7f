"""Finding, converting and loading a model from disk.

Holds the catalog of named models and the target/draft pairing (catalog.py), GGUF files made into
Hugging Face directories (gguf.py), safetensors and tokenizer loading (loader.py), the tokenizer without
transformers (tokenizer.py), and prompts from a chat template (chat.py). Nothing here is fetched from a
hub: every model is a local directory or file.

May import: the model room (``engine.model``) and the engine's leaves; never the scheduler core.
"""
