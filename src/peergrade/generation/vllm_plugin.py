"""peergrade's vLLM plugin: a weight-transfer backend, ``peergrade_shm``, for a vLLM server on
the trainer's machine (``rollout.vllm_mode server``; docs/engines.md).

vLLM loads it in each of its processes through the ``vllm.general_plugins`` entry point
(``pyproject.toml``), so any server started with
``--weight-transfer-config '{"backend": "peergrade_shm"}'`` (and ``VLLM_SERVER_DEV_MODE=1``,
which turns on vLLM's weight-transfer routes) takes weights pushed this way:

- the trainer writes the policy's tensors, under the Hugging Face names, to one safetensors
  file in shared memory (``/dev/shm``) and posts its path to vLLM's ``/update_weights``
  between ``/start_weight_update`` and ``/finish_weight_update``
  (``vllm_server.ShmPusher``);
- each worker reads the file and loads the tensors with vLLM's layerwise reload
  (``initialize_layerwise_reload``, the model's ``load_weights``,
  ``finalize_layerwise_reload``): the same three calls as the in-process
  ``reload_weights`` that ``VllmEngine`` uses, so weights the CPU backend repacks at load
  time are repacked again (a bare ``load_weights`` fails on them).

The file is the trainer's to delete. Nothing here is imported by peergrade itself: only vLLM
imports this module (``register``), and only vLLM's worker builds the engine class.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the backend's name in vLLM's registry (``--weight-transfer-config '{"backend": ...}'``)
BACKEND = "peergrade_shm"
#: the wire format the trainer and this engine agree on (checked at the init handshake)
PROTOCOL = 1


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``peergrade_shm`` with vLLM's
    weight-transfer registry (once per process: vLLM may call plugins more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "ShmWeightTransferEngine")


def __getattr__(name: str):
    """``ShmWeightTransferEngine`` is built on first access (it subclasses vLLM's engine base,
    so this module imports without vLLM)."""
    if name == "ShmWeightTransferEngine":
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


@dataclass
class ShmInitInfo:
    """What the trainer sends to ``/init_weight_transfer_engine``."""

    protocol: int = PROTOCOL


@dataclass
class ShmUpdateInfo:
    """What the trainer sends to ``/update_weights``: the safetensors file to load."""

    path: str


def _engine_class():
    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class ShmWeightTransferEngine(WeightTransferEngine):
        """Worker side of ``peergrade_shm`` (see the module docstring)."""

        init_info_cls = ShmInitInfo
        update_info_cls = ShmUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
            if init_info.protocol != PROTOCOL:
                raise ValueError(
                    f"{BACKEND}: the trainer speaks protocol {init_info.protocol}, this "
                    f"server's peergrade {PROTOCOL}: install the same peergrade in both"
                )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.current_accelerator() is not None:
                torch.accelerator.synchronize()  # the base class's; there is none on a CPU

        def receive_weights(self, update_info: ShmUpdateInfo) -> None:
            from safetensors import safe_open

            with safe_open(update_info.path, framework="pt", device="cpu") as f:
                names = list(f.keys())  # noqa: SIM118 (safe_open is not iterable)
                self.model.load_weights((k, f.get_tensor(k)) for k in names)

        def shutdown(self) -> None:
            pass

    return ShmWeightTransferEngine
