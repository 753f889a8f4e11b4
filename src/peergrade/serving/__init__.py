"""The serving wing: the OpenAI-compatible endpoint (``peergrade serve``) and the external
agents' episodes it records for training (``train --harness``).

``server`` (the app, its routes, the engine that answers them), ``openai_schema`` (the requests
it accepts and OpenAI's error shape), ``responses`` (the Responses API over the chat route),
``stream`` (server-sent events, sent as tokens are sampled), ``recorder`` (a training episode's
requests kept as tokens, a follow-up matched to its recorded prefix) and ``harness`` (the runner
that serves the policy to an external agent and hands the trainer ``Samples``).

It samples through ``peergrade.generation`` (the kernel and the sessions behind it) and never
runs a sampling loop of its own; ``generation`` never imports it.
"""
