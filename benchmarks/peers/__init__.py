"""llm-compressor as a peer: ``run_peer`` (our venv) drives ``llmcompressor_prune.py`` (its own
venv, run as a script by path: it must not import this package)."""
