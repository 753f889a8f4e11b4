"""tinker-cookbook's ``recipes/sl_loop.py`` (supervised, ``cross_entropy``) against a local
Tinker, on two-digit arithmetic written out as chat turns.

The Tinker calls are the cookbook loop's: ``create_lora_training_client``, per batch datums with
``target_tokens`` and ``weights`` (1 on the reply's tokens, 0 on the prompt's) ->
``forward_backward(datums, "cross_entropy")`` -> ``optim_step(AdamParams)`` with a linearly
decaying learning rate, and the cookbook's ``train_mean_nll`` (the weighted mean of
``-logprobs`` over the batch, ``tinker_cookbook.supervised.common.compute_mean_nll``'s formula).
The data is peergrade's arithmetic task instead of a Hub dataset.

    python examples/tinker/sl_loop.py --max-steps 40
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time


def datum_of(tokenizer, row, types):
    """One supervised datum: the chat prompt, then the answer and EOS as the reply."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    reply = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
    full = prompt + reply
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def mean_nll(fwd_bwd_result, datums) -> float:
    """``compute_mean_nll``: sum(-logprobs * weights) / sum(weights) over the batch."""
    num = den = 0.0
    for out, d in zip(fwd_bwd_result.loss_fn_outputs, datums):
        lp = out["logprobs"].tolist()
        w = d.loss_fn_inputs["weights"].tolist()
        num += sum(-a * b for a, b in zip(lp, w))
        den += sum(w)
    return num / den


def run(
    *,
    base_url: str | None = None,
    model_name: str = "bundled",
    batch_size: int = 32,
    learning_rate: float = 1e-3,
    lora_rank: int = 8,
    max_steps: int = 40,
    seed: int = 0,
    log=print,
) -> list[dict]:
    import tinker
    from tinker import types

    from peergrade.tasks.arithmetic import ArithmeticTask

    server = None
    if base_url is None:
        from peergrade.tinker_server import TinkerServer

        server = TinkerServer(root=tempfile.mkdtemp(prefix="tinker-sl-"), seed=seed)
        base_url = server.start()
    # a local server takes any key with the tml- prefix; a real one needs TINKER_API_KEY
    api_key = os.environ.get("TINKER_API_KEY") or "tml-local"
    rows = ArithmeticTask(ops="+").train_rows(seed=seed)
    history = []
    service_client = None
    try:
        service_client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        training_client = service_client.create_lora_training_client(
            base_model=model_name, rank=lora_rank, seed=seed
        ).result()
        tokenizer = training_client.get_tokenizer()
        for step in range(max_steps):
            t0 = time.time()
            lr = learning_rate * (1.0 - step / max_steps)  # the cookbook's linear decay
            datums = [datum_of(tokenizer, r, types) for r in itertools.islice(rows, batch_size)]
            fwd_bwd_future = training_client.forward_backward(datums, loss_fn="cross_entropy")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=lr))
            fwd_bwd_result = fwd_bwd_future.result()
            optim_future.result()
            metrics = {
                "step": step,
                "learning_rate": lr,
                "train_mean_nll": mean_nll(fwd_bwd_result, datums),
                "time/total": time.time() - t0,
            }
            history.append(metrics)
            log(json.dumps(metrics))
    finally:
        if service_client is not None:  # stops its heartbeats (and their retries) first
            service_client.close("success").result(timeout=60)
        if server is not None:
            server.close()
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--model-name", default="bundled")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    run(
        base_url=a.base_url,
        model_name=a.model_name,
        batch_size=a.batch_size,
        learning_rate=a.learning_rate,
        lora_rank=a.lora_rank,
        max_steps=a.max_steps,
        seed=a.seed,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
