"""Models: loading (HF dirs, GGUF, LoRA), the chunked log-prob engine, tiny models.

Import the modules themselves (``from peergrade.model import ...``); this file imports nothing."""
