"""Tinker's wire formats, read and written with the installed ``tinker`` SDK's own definitions
(its protobuf module and pydantic types), so what the server accepts and answers is what that
SDK version sends and expects.

Two bodies are protobuf: the ``forward_backward`` request, and the ``ForwardBackwardOutput`` /
``SampleResponse`` results (the SDK asks for them with ``Accept: application/x-protobuf`` and
accepts no JSON for those two); every other body is JSON of the SDK's pydantic models.

It deliberately holds no state and does no work: ``engine`` trains and samples, ``server``
routes.
"""

from __future__ import annotations

import numpy as np
import torch

from peergrade.tinker_server.engine import Datum, SampleResult

__all__ = [
    "encode_forward_backward_output",
    "encode_sample_response",
    "model_input_ids",
    "parse_forward_backward",
]


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _chunk_tokens(chunk, where: str) -> list[int]:
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
        raise ValueError(f"{where}: only text chunks are served locally (got {kind!r})")
    return np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()


def _tensor(msg, where: str) -> torch.Tensor:
    pb = _pb()
    dtypes = {
        pb.DTYPE_FLOAT32: np.float32,
        pb.DTYPE_INT64: np.int64,
        pb.DTYPE_INT32: np.int32,
    }
    if msg.dtype not in dtypes:
        raise ValueError(f"{where}: unsupported tensor dtype {msg.dtype}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtypes[msg.dtype])
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtypes[msg.dtype])
        for r in range(len(crow) - 1):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        arr = dense
    else:
        arr = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype]).copy()
        if shape:
            arr = arr.reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(arr))


def parse_forward_backward(body: bytes) -> dict:
    """The protobuf ``forward_backward`` request -> ``{model_id, seq_id, loss_fn,
    loss_fn_config, forward_only, data: [engine.Datum]}``."""
    msg = _pb().ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        ids: list[int] = []
        for chunk in d.model_input:
            ids += _chunk_tokens(chunk, f"datum {i}")
        inputs = {
            k: _tensor(t, f"datum {i} loss_fn_inputs[{k!r}]") for k, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(input_ids=ids, loss_fn_inputs=inputs))
    return {
        "model_id": msg.model_id,
        "seq_id": msg.seq_id,
        "loss_fn": msg.loss_fn,
        "loss_fn_config": config,
        "forward_only": bool(msg.forward_only),
        "data": data,
    }


def encode_forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict) -> bytes:
    """Per-datum float32 outputs (each ``[N_i]``) and metrics as the protobuf the SDK decodes."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [o[name].detach().cpu().numpy().astype(np.float32).ravel() for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


#: the SDK's filler for an empty top-k cell (``tinker.types.topk_logprobs.MASK_LOGPROB``)
_TOPK_EMPTY_LOGPROB = -99999.0


def _encode_topk(msg, rows: list, k: int) -> None:
    """Per-position top-k lists (None: no entry) into the SDK's dense ``TopkLogprobs``:
    row-major ``[length, k]`` int32 ids and float32 log-probs, empty cells ``(0, -99999)``."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), _TOPK_EMPTY_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = tok, lp
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()
    msg.k, msg.length = k, len(rows)


def encode_sample_response(result: SampleResult, *, topk_prompt: int = 0, topk_sample: int = 0):
    pb = _pb()
    out = pb.SampleResponse()
    for s in result.sequences:
        seq = out.sequences.add()
        seq.stop_reason = (
            pb.STOP_REASON_LENGTH if s.stop_reason == "length" else pb.STOP_REASON_STOP
        )
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk is not None and topk_sample > 0:
            _encode_topk(seq.topk_sampled_logprobs, s.topk, topk_sample)
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype=np.float32).tobytes()
    if result.topk_prompt is not None and topk_prompt > 0:
        _encode_topk(out.topk_prompt_logprobs, result.topk_prompt, topk_prompt)
    return out.SerializeToString()


def model_input_ids(model_input) -> list[int]:
    """Token ids of an SDK ``ModelInput`` (text chunks only)."""
    ids: list[int] = []
    for chunk in model_input.chunks:
        tokens = getattr(chunk, "tokens", None)
        if tokens is None:
            raise ValueError(f"only text chunks are served locally (got {type(chunk).__name__})")
        ids += list(tokens)
    return ids
