"""Tinker's API on your own machine: a local server speaking Tinker's HTTP protocol, so the
real ``tinker`` SDK and tinker-cookbook recipes run here with only ``base_url`` changed.

Modules: ``engine`` (the work: a training run with LoRA or full fine-tuning, the sampler over
weight snapshots; plain torch, no SDK), ``wire`` (the SDK's protobuf / JSON bodies), ``server``
(routes, futures, checkpoints under a root directory), ``__main__`` (``python -m
peergrade.tinker_server``). The loss formulas are ``peergrade.algo.tinker_losses``.

It does not vendor or shadow the ``tinker`` package: the SDK is an optional dependency (the
``tinker`` extra), imported only by ``wire`` and ``server``.
"""

from __future__ import annotations

__all__ = ["TinkerServer", "DEFAULT_API_KEY"]


def __getattr__(name: str):
    if name in __all__:
        from peergrade.tinker_server import server

        return getattr(server, name)
    raise AttributeError(name)
