"""Generation: the sampling kernel (keyed draws, slab KV cache, EOS/stop) and the episode engine.

Import the modules themselves (``from peergrade.generation import ...``); this file imports nothing."""
