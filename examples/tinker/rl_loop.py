"""tinker-cookbook's ``recipes/rl_loop.py`` on two-digit arithmetic, against a local Tinker.

Every Tinker call is the cookbook loop's, in its order: ``ServiceClient(base_url=...)``,
``create_lora_training_client`` (rank 0 = full fine-tuning), per batch
``save_weights_and_get_sampling_client`` -> ``sample(prompt, num_samples=G)`` per problem ->
group-centred advantages (groups with no spread skipped) -> datums with ``target_tokens``,
``logprobs`` (the sampler's) and ``advantages`` -> ``forward_backward(datums, loss_fn)`` ->
``optim_step(AdamParams)``, with ``save_state`` checkpoints. What differs is the data (GSM8K
needs the Hub and a model that can read; this uses peergrade's arithmetic task and its
``arithmetic`` reward, which the bundled model can learn on a CPU) and that the prompt is the
model's chat template instead of a cookbook renderer.

    python examples/tinker/rl_loop.py                        # in-process server, bundled model
    python examples/tinker/rl_loop.py --base-url http://127.0.0.1:8000   # a running server

It prints one JSON line per batch (``reward/total`` as the cookbook logs it) and a summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time


def run(
    *,
    base_url: str | None = None,
    model_name: str = "bundled",
    batch_size: int = 16,
    group_size: int = 8,
    learning_rate: float = 3e-4,
    lora_rank: int = 0,
    max_tokens: int = 8,
    loss_fn: str = "importance_sampling",
    loss_fn_config: dict | None = None,
    max_steps: int = 100,
    save_every: int = 0,
    seed: int = 0,
    log=print,
) -> list[dict]:
    import tinker
    import torch
    from tinker import types
    from tinker.types.tensor_data import TensorData

    from peergrade.rewards.math import arithmetic
    from peergrade.tasks.arithmetic import ArithmeticTask

    server = None
    if base_url is None:  # the local server in this process (examples and tests)
        from peergrade.tinker_server import TinkerServer

        server = TinkerServer(root=tempfile.mkdtemp(prefix="tinker-rl-"), seed=seed)
        base_url = server.start()
    # a local server takes any key with the tml- prefix; a real one needs TINKER_API_KEY
    api_key = os.environ.get("TINKER_API_KEY") or "tml-local"
    rows = ArithmeticTask().train_rows(seed=seed)
    history: list[dict] = []
    service_client = None
    try:
        service_client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        training_client = service_client.create_lora_training_client(
            base_model=model_name, rank=lora_rank, seed=seed
        ).result()
        tokenizer = training_client.get_tokenizer()
        sampling_params = types.SamplingParams(max_tokens=max_tokens)
        adam_params = types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
        for batch_idx in range(max_steps):
            t_start = time.time()
            metrics: dict[str, float] = {"progress/batch": batch_idx, "optim/lr": learning_rate}
            if save_every > 0 and batch_idx % save_every == 0 and batch_idx > 0:
                training_client.save_state(f"{batch_idx:06d}").result()
            batch_rows = list(itertools.islice(rows, batch_size))
            sampling_client = training_client.save_weights_and_get_sampling_client().result()

            datums_D: list[types.Datum] = []
            rewards_P: list[float] = []
            futures_P, prompts_P = [], []
            for row in batch_rows:
                ids = tokenizer.apply_chat_template(
                    row["prompt"], add_generation_prompt=True, tokenize=True
                )
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                model_input = types.ModelInput.from_ints(list(ids))
                futures_P.append(
                    sampling_client.sample(
                        prompt=model_input, num_samples=group_size, sampling_params=sampling_params
                    )
                )
                prompts_P.append(model_input)

            for future, prompt, row in zip(futures_P, prompts_P, batch_rows):
                sample_result = future.result()
                texts = [
                    tokenizer.decode(s.tokens, skip_special_tokens=True)
                    for s in sample_result.sequences
                ]
                rewards_G = arithmetic(None, texts, [row["answer"]] * len(texts))
                mean_reward = sum(rewards_G) / len(rewards_G)
                advantages_G = [r - mean_reward for r in rewards_G]
                rewards_P.append(mean_reward)
                if all(a == 0.0 for a in advantages_G):
                    continue
                for sequence, advantage in zip(sample_result.sequences, advantages_G):
                    sampled_tokens, logprobs = sequence.tokens, sequence.logprobs
                    ob_len = prompt.length - 1
                    model_input = prompt.append(types.EncodedTextChunk(tokens=sampled_tokens[:-1]))
                    target_tokens = [0] * ob_len + sampled_tokens
                    padded_logprobs = [0.0] * ob_len + logprobs
                    padded_advantages = [0.0] * ob_len + [advantage] * (model_input.length - ob_len)
                    loss_fn_inputs = {
                        "target_tokens": TensorData.from_torch(torch.tensor(target_tokens)),
                        "logprobs": TensorData.from_torch(torch.tensor(padded_logprobs)),
                        "advantages": TensorData.from_torch(torch.tensor(padded_advantages)),
                    }
                    if loss_fn == "gspo":  # the sequence ratio over the sampled tokens
                        ratio_mask = [0.0] * ob_len + [1.0] * len(sampled_tokens)
                        loss_fn_inputs["sequence_ratio_mask"] = TensorData.from_torch(
                            torch.tensor(ratio_mask)
                        )
                    datums_D.append(
                        types.Datum(model_input=model_input, loss_fn_inputs=loss_fn_inputs)
                    )
            if datums_D:
                fwd_bwd_future = training_client.forward_backward(
                    datums_D, loss_fn=loss_fn, loss_fn_config=loss_fn_config
                )
                optim_step_future = training_client.optim_step(adam_params)
                fwd_bwd_result = fwd_bwd_future.result()
                optim_result = optim_step_future.result()
                metrics["loss:sum"] = fwd_bwd_result.metrics["loss:sum"]
                metrics.update(optim_result.metrics or {})
            metrics["time/total"] = time.time() - t_start
            metrics["reward/total"] = sum(rewards_P) / len(rewards_P)
            history.append(metrics)
            log(json.dumps(metrics))
    finally:
        if service_client is not None:  # stops its heartbeats (and their retries) first
            service_client.close("success").result(timeout=60)
        if server is not None:
            server.close()
    return history


def summary(history: list[dict], window: int = 10) -> dict:
    """Mean ``reward/total`` of the first and the last ``window`` batches, and the rise."""
    r = [m["reward/total"] for m in history]
    w = max(1, min(window, len(r) // 2))
    first, last = sum(r[:w]) / w, sum(r[-w:]) / w
    return {"steps": len(r), "window": w, "first": first, "last": last, "rise": last - first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--model-name", default="bundled")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--loss-fn",
        default="importance_sampling",
        help="a Tinker loss (importance_sampling, ppo, cispo, dro, gspo) or peergrade:<name> "
        "(grpo, dapo, dr_grpo, cispo, sapo, luspo, vespo, bnpo; docs/tinker.md)",
    )
    ap.add_argument(
        "--loss-fn-config",
        type=json.loads,
        default=None,
        help="loss_fn_config as JSON, e.g. '{\"beta\": 0.05}' for dro",
    )
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    history = run(
        base_url=a.base_url,
        model_name=a.model_name,
        batch_size=a.batch_size,
        group_size=a.group_size,
        learning_rate=a.learning_rate,
        lora_rank=a.lora_rank,
        max_tokens=a.max_tokens,
        loss_fn=a.loss_fn,
        loss_fn_config=a.loss_fn_config,
        max_steps=a.max_steps,
        seed=a.seed,
    )
    print(json.dumps({"summary": summary(history)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
