"""The GRPO training loop. It reads top to bottom: one function per phase, then ``train``.

One step:
  P prompts (with solved example turns early on when ``data.few_shot`` is set: ``FewShot``)
  -> G completions each (``rollout.generate``) -> rewards (weighted reward functions)
  -> group-relative advantages (``algo.group_advantages``) -> reference log-probs (beta > 0)
  -> mu passes of minibatch updates with ``algo.policy_loss`` (gradient accumulation over
  micro-batches, the loss normaliser is the minibatch's) -> clip grad norm -> AdamW + schedule
  -> metrics.jsonl, samples.jsonl -> checkpoint.

Exact resume: everything random is derived from (seed, step) -- the prompts of step s are rows
[s*P, (s+1)*P) of the task's seeded stream, the sampling seed of step s is a function of
(seed, step), minibatch shuffles likewise -- so a run resumed from ``checkpoints/step-s`` (model,
optimizer, scheduler, RNG states) produces the same metrics and weights as one never stopped.

``algo.name: ppo`` swaps step 3 and 5 for the critic baseline (``peergrade.ppo``: per-token
rewards, GAE, a value model with its own optimizer); everything else is shared.

This is the only module that reads the whole config. It does not implement the math (algo),
the sampler (rollout), log-probs and loading (models), rewards or tasks.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peergrade import checkpoint as ckpt
from peergrade.algo import group_advantages, policy_loss
from peergrade.config import Config, to_yaml
from peergrade.errors import InputError, user_input
from peergrade.evaluation import (
    FORMAT_KEYS,
    accuracy_spec,
    answer_format_spec,
    asks_for_answer_tags,
    columns_for,
    completion_id_lists,
    encode_prompts,
    evaluate,
    reward_state,
)
from peergrade.metrics import Display, JsonlWriter
from peergrade.models import (
    apply_lora,
    disable_adapter,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    token_logprobs,
)
from peergrade.rewards import RewardSpec, make_reward_specs, score_rewards
from peergrade.rollout import generate
from peergrade.tasks import load_task
from peergrade.tasks.prompts import with_examples

# ----------------------------------------------------------------------------- setup helpers


def build_task(cfg: Config):
    d = cfg.data
    with user_input("data"):
        if d.path is not None:
            return load_task(
                "file", path=d.path, eval_path=d.eval_path, columns=d.columns, **d.task_options
            )
        return load_task(d.task, **d.task_options)


def build_rewards(cfg: Config, task) -> list[RewardSpec]:
    """The configured reward mix, or the task's default rewards when none is configured."""
    with user_input("rewards"):
        if cfg.rewards:
            items = [(i.name, i.weight, i.kwargs, i.display_name) for i in cfg.rewards]
        else:
            items = [(name, w, {}, None) for name, w in task.default_rewards]
        specs = make_reward_specs(items)
    if not specs:
        raise InputError(
            f"task {task.name!r} has no default reward: name one with --reward or `rewards:`"
        )
    return specs


def build_optimizer(params, cfg_optim, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over ``params``; the fused kernel when every tensor is a float on CPU or CUDA.

    Fused AdamW updates each parameter in one kernel with no temporaries, where the default
    CPU path allocates two buffers the size of the largest parameter per tensor step (the
    embedding, ~0.1 GB on a 30M model) and CUDA's foreach path one copy of all of them."""
    params = list(params)
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )
    return torch.optim.AdamW(
        params,
        lr=cfg_optim.lr if lr is None else lr,
        betas=tuple(cfg_optim.adam_betas),
        weight_decay=cfg_optim.weight_decay,
        fused=fused or None,
    )


def lr_lambda(cfg_optim, total_updates: int):
    warm, kind, floor = cfg_optim.warmup_steps, cfg_optim.lr_schedule, cfg_optim.min_lr_ratio

    def f(i: int) -> float:
        if warm > 0 and i < warm:
            return (i + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (i - warm) / max(1, total_updates - warm))
        if kind == "linear":
            return floor + (1 - floor) * (1 - frac)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        raise ValueError(f"unknown lr_schedule {kind!r}: expected constant, cosine or linear")

    return f


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + salt) % (2**63 - 1)


class FewShot:
    """``data.few_shot``: solved example turns before training prompts, faded out over steps.

    The examples come from a pool of the task's own training problems (a separate stream from
    the prompts, so held-out problems never appear; an example never repeats the question it
    precedes), with ``data.few_shot_answer`` as the reply. Which prompts get examples, and
    which ones, depends on (seed, step) only, so a resumed run sees the same prompts."""

    POOL = 256

    def __init__(self, cfg_data, task, seed: int):
        self.k, self.fade, self.seed = cfg_data.few_shot, cfg_data.few_shot_fade_steps, seed
        self.pool: list[tuple[Any, str]] = []
        if self.k:
            rows = itertools.islice(task.train_rows(seed + 1), self.POOL)
            self.pool = [
                (row["prompt"], _reply(cfg_data.few_shot_answer, row, i))
                for i, row in enumerate(rows)
            ]

    def chance(self, step: int) -> float:
        """Probability that a prompt of ``step`` (1-based) carries the examples."""
        if not self.k:
            return 0.0
        if not self.fade:
            return 1.0
        return max(0.0, 1.0 - (step - 1) / self.fade)

    def apply(self, rows: list[dict], step: int) -> tuple[list[dict], float]:
        """``rows`` with examples put into some prompts, and the fraction that got them."""
        p = self.chance(step)
        if p == 0.0:
            return rows, 0.0
        rng = random.Random(step_seed(self.seed, step, salt=7))
        out, hits = [], 0
        for row in rows:
            if rng.random() < p:
                others = [ex for ex in self.pool if ex[0] != row["prompt"]]
                examples = rng.sample(others, min(self.k, len(others)))
                row = {**row, "prompt": with_examples(row["prompt"], examples)}
                hits += 1
            out.append(row)
        return out, hits / max(1, len(rows))


def _reply(template: str, row: dict, i: int) -> str:
    try:
        return template.format(**row)
    except (KeyError, IndexError, ValueError) as exc:
        raise InputError(
            f"data.few_shot_answer {template!r} cannot be filled from training row {i} "
            f"(its columns: {', '.join(row)}): {type(exc).__name__}: {exc}"
        ) from None


# ----------------------------------------------------------------------------- one step


@dataclass
class Models:
    policy: Any
    tokenizer: Any
    reference: Any  # None, a frozen copy, or "adapter" (LoRA: the policy with its adapter disabled)
    device: torch.device


def micro_batches(idx: torch.Tensor, size: int):
    for i in range(0, len(idx), size):
        yield idx[i : i + size]


def trim(input_ids, attention_mask, cmask):
    """Drop all-padding columns of a micro-batch: leading prompt padding, trailing completion padding."""
    C = cmask.shape[1]
    keep_c = int(cmask.sum(dim=0).nonzero().max().item()) + 1 if cmask.any() else 1
    L = input_ids.shape[1]
    prompt_cols = attention_mask[:, : L - C].sum(dim=0)
    first = int(prompt_cols.nonzero().min().item()) if prompt_cols.any() else L - C
    end = L - C + keep_c
    return input_ids[:, first:end], attention_mask[:, first:end], cmask[:, :keep_c]


def logprobs_of(model, input_ids, attention_mask, cmask, cfg, *, with_entropy=False):
    return token_logprobs(
        model,
        input_ids,
        attention_mask,
        cmask,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.model.logprob_chunk_size,
        with_entropy=with_entropy,
    )


def sample(policy, tokenizer, prompt_ids, cfg: Config, step: int):
    """G completions for each prompt with the configured sampling settings, seeded by step."""
    r = cfg.rollout
    return generate(
        policy,
        tokenizer,
        prompt_ids,
        n=r.group_size,
        max_new_tokens=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop=r.stop,
        seed=step_seed(cfg.train.seed, step),
        batch_size=r.generation_batch_size,
    )


@torch.no_grad()
def frozen_logprobs(model, batch, cfg, idx_all, micro):
    """Log-probs of ``model`` (no grad) for every sequence, [N, C]; used for ref and old policy."""
    input_ids, attention_mask, cmask = batch
    out = torch.zeros(cmask.shape, dtype=torch.float32, device=cmask.device)
    for mb in micro_batches(idx_all, micro):
        ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
        out[mb, : cm.shape[1]] = logprobs_of(model, ii, am, cm, cfg).float()
    return out


def ref_logprobs(models: Models, batch, cfg, idx_all, micro):
    if models.reference is None:
        return None
    if models.reference == "adapter":
        with disable_adapter(models.policy) as base:
            return frozen_logprobs(base, batch, cfg, idx_all, micro)
    ref = models.reference
    home = next(ref.parameters()).device
    if home == models.device:
        return frozen_logprobs(ref, batch, cfg, idx_all, micro)
    ref.to(models.device)  # model.ref_offload: on the device for this pass only
    try:
        return frozen_logprobs(ref, batch, cfg, idx_all, micro)
    finally:
        ref.to(home)


class MeanMetrics:
    """Weighted means of the scalar metrics of one update call."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float, w: int = 1) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * w
        self.counts[key] = self.counts.get(key, 0) + w

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / max(self.counts[k], 1) for k in self.sums}


def minibatch_schedule(cfg: Config, step: int, N: int, device):
    """The minibatches (index tensors) of one update call: ``algo.num_iterations`` passes over
    the N rows, each pass in an order seeded by (seed, step, pass), cut into
    ``optim.minibatch_size`` pieces (one optimizer step each)."""
    mini = cfg.optim.minibatch_size or N
    all_idx = torch.arange(N, device=device)
    for it in range(cfg.algo.num_iterations):
        g = torch.Generator().manual_seed(step_seed(cfg.train.seed, step, salt=1 + it))
        order = all_idx if mini == N else torch.randperm(N, generator=g).to(device)
        yield from micro_batches(order, mini)


def update(models: Models, optimizer, scheduler, batch, advantages, ref_lp, cfg: Config, step: int):
    """mu passes of minibatch updates; returns averaged metrics."""
    input_ids, attention_mask, cmask = batch
    N = cmask.shape[0]
    mini = cfg.optim.minibatch_size or N
    micro = min(cfg.optim.micro_batch_size, mini)
    mu = cfg.algo.num_iterations
    single_update = mu == 1 and mini == N
    all_idx = torch.arange(N, device=cmask.device)
    # Zero advantages and no KL term make every token's loss exactly 0, so the gradient is 0:
    # such a minibatch gets zero gradients without a forward/backward pass (AdamW then steps
    # exactly as it would have). Common early on, when a model never earns any reward.
    kl_on = cfg.algo.beta > 0 and ref_lp is not None

    def no_signal(idx) -> bool:
        return not kl_on and bool((advantages[idx] == 0).all())

    # With one optimizer step per batch, the old policy is the current one: old = logp.detach().
    need_old = not single_update and not no_signal(all_idx)
    old_lp = frozen_logprobs(models.policy, batch, cfg, all_idx, micro) if need_old else None
    params = [p for p in models.policy.parameters() if p.requires_grad]
    metrics = MeanMetrics()
    add = metrics.add

    models.policy.train()
    for mini_idx in minibatch_schedule(cfg, step, N, cmask.device):
        num_tokens = cmask[mini_idx].sum()
        optimizer.zero_grad(set_to_none=True)
        skip = no_signal(mini_idx)
        add("update/zero_signal_frac", float(skip))
        if skip:
            add("loss/policy", 0.0, len(mini_idx))  # exactly: every token's loss is 0
            for p in params:
                p.grad = torch.zeros_like(p)
        for mb in [] if skip else micro_batches(mini_idx, micro):
            ii, am, cm = trim(input_ids[mb], attention_mask[mb], cmask[mb])
            Tc = cm.shape[1]
            logp, ent = logprobs_of(models.policy, ii, am, cm, cfg, with_entropy=True)
            old = logp.detach() if old_lp is None else old_lp[mb, :Tc]
            ref = None if ref_lp is None else ref_lp[mb, :Tc]
            loss, m = policy_loss(
                logp,
                old,
                advantages[mb],
                cm,
                loss_type=cfg.algo.loss_type,
                ratio_level=cfg.algo.ratio_level,
                clip_eps=cfg.algo.clip_eps,
                clip_eps_high=cfg.algo.clip_eps_high,
                ref_logp=ref,
                beta=cfg.algo.beta,
                kl_estimator=cfg.algo.kl_estimator,
                max_completion_length=cfg.rollout.max_completion_length,
                num_tokens=num_tokens,
            )
            # dapo/cispo already divide by the minibatch's token count; the per-micro-batch
            # normalised types are averaged over micro-batches weighted by their size.
            scale = 1.0 if cfg.algo.loss_type in ("dapo", "cispo") else len(mb) / len(mini_idx)
            (loss * scale).backward()
            w = len(mb)
            add("loss/policy", loss.item(), w)
            for k, v in m.items():
                add(k, float(v), w)
            n_tok = cm.sum().item()
            if n_tok > 0:
                add("entropy/mean", (ent.detach() * cm).sum().item() / n_tok, w)
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        add("grad/norm", float(gnorm))
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out = metrics.means()
    out["optim/lr"] = scheduler.get_last_lr()[0]
    return out


# ----------------------------------------------------------------------------- the loop


class _StopFlag:
    """First Ctrl-C: finish the current step, save, exit. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False

    @contextmanager
    def installed(self, display):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            display.print(
                "[interrupt] finishing this step, saving a checkpoint, then exiting "
                "(Ctrl-C again to stop at once)"
            )

        try:
            old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, old)


def setup_models(cfg: Config) -> Models:
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(path)
    gc = cfg.model.gradient_checkpointing
    if gc is None:
        gc = device.type == "cuda"
    policy = load_model(path, dtype=dtype, device=str(device), gradient_checkpointing=gc)
    reference = None
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        policy = apply_lora(
            policy, r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules
        )
        if cfg.algo.beta > 0:
            reference = "adapter"
    elif cfg.algo.beta > 0 and cfg.model.ref_offload and device.type != "cpu":
        # loaded straight into host memory: never two copies on the device
        reference = load_model(path, dtype=dtype, device="cpu").eval().requires_grad_(False)
    elif cfg.algo.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    return Models(policy, tokenizer, reference, device)


def train(
    cfg: Config, run_dir: Path, *, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Run (or resume) GRPO training into ``run_dir``; returns the final summary.

    A non-empty ``run_dir`` is refused unless ``resume`` (continue it) or ``overwrite`` (replace
    it, once everything has loaded)."""
    run_dir = Path(run_dir)
    ckpt.check_run_dir(run_dir, resume=resume, overwrite=overwrite)
    t, r = cfg.train, cfg.rollout
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)

    task = build_task(cfg)
    reward_specs = build_rewards(cfg, task)
    few_shot = FewShot(cfg.data, task, t.seed)
    # 'accuracy' = the task's own verifier, or the first configured reward when it has none
    acc = accuracy_spec(task) if task.default_rewards else reward_specs[0]
    # When the verifier is already in the reward mix (the usual case), reuse its scores.
    acc_in_mix = any(
        s.name == acc.name and s.fn is acc.fn and s.kwargs == acc.kwargs for s in reward_specs
    )
    system_prompt = cfg.data.system_prompt or task.system_prompt
    models = setup_models(cfg)
    policy, tok = models.policy, models.tokenizer

    P, G = r.prompts_per_step, r.group_size
    N = P * G
    mini = cfg.optim.minibatch_size or N
    updates_per_step = cfg.algo.num_iterations * (N // mini)
    optimizer = build_optimizer((p for p in policy.parameters() if p.requires_grad), cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim, t.steps * updates_per_step)
    )
    # PPO: a critic (value model + its AdamW), the memory GRPO does without; checkpoints carry it.
    critic, opt_state = None, optimizer
    if cfg.algo.name == "ppo":
        from peergrade import ppo

        critic = ppo.build_critic(cfg, models)
        opt_state = ppo.CriticCheckpointState(optimizer, critic)

    # A user dataset without eval_path / eval_fraction has no held-out split: train, skip evals.
    eval_rows = task.eval_rows(t.eval_size) if getattr(task, "has_eval", True) else []
    eval_ids = encode_prompts(
        eval_rows,
        tok,
        system_prompt=system_prompt,
        use_chat_template=cfg.data.use_chat_template,
        max_prompt_length=cfg.data.max_prompt_length,
    )
    config_yaml = to_yaml(cfg)
    display = Display(t.display, t.steps)

    def run_eval(step_for_seed: int) -> dict[str, float] | None:
        if not eval_rows:
            return None
        return evaluate(
            policy,
            tok,
            eval_rows,
            eval_ids,
            acc,
            k=t.eval_samples,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_completion_length,
            seed=step_seed(t.seed, 0, salt=99),
            batch_size=r.generation_batch_size,
            stop=r.stop,
            extra=[answer_format_spec()] if asks_for_answer_tags(eval_rows) else [],
            trainer_state=reward_state(task, step_for_seed + 1, t.steps, P, G),
        )

    start_step = 0
    state: dict[str, Any] = {}
    if resume:
        last = ckpt.latest_checkpoint(run_dir)
        state = ckpt.read_trainer_state(last)
        start_step = state["step"]
        loaded = load_model(
            str(last),
            dtype=resolve_dtype(cfg.model.dtype, models.device),
            device=str(models.device),
        )
        policy.load_state_dict(loaded.state_dict())
        del loaded
        training = ckpt.load_training_state(last)
        opt_state.load_state_dict(training["optimizer"])
        scheduler.load_state_dict(training["scheduler"])
        ckpt.set_rng_state(training["rng"])
        for name in ("metrics.jsonl", "samples.jsonl"):
            ckpt.truncate_jsonl(run_dir / name, start_step)
        display.print(f"resuming {run_dir} from {last.name}")
    else:
        if overwrite and run_dir.exists():
            shutil.rmtree(run_dir)  # only now: a failure while loading left the old run intact
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.atomic_write_text(run_dir / "config.yaml", config_yaml)
    metrics_log = JsonlWriter(run_dir / "metrics.jsonl")
    samples_log = JsonlWriter(run_dir / "samples.jsonl")

    if not eval_rows:
        display.print(
            "no held-out split (set data.eval_path or task_options.eval_fraction): "
            "evaluation is skipped",
            always=True,
        )
    if "eval_before" not in state:
        if eval_rows:
            display.print("evaluating the starting model on the held-out split ...")
        state["eval_before"] = run_eval(0)
        if state["eval_before"]:
            metrics_log.write(
                {"step": 0, **{f"eval/{k}": v for k, v in state["eval_before"].items()}}
            )
    display.close()  # the bar shown while loading/evaluating; a fresh one times the steps
    display = Display(t.display, t.steps, start_step)

    rows_iter = itertools.islice(task.train_rows(t.seed), start_step * P, None)
    stop = _StopFlag()
    step = start_step
    last_saved = start_step if resume else -1

    def save(at_step: int):
        nonlocal last_saved
        ckpt.save_checkpoint(
            run_dir,
            at_step,
            model=policy,
            tokenizer=tok,
            optimizer=opt_state,
            scheduler=scheduler,
            trainer_state={"eval_before": state["eval_before"]},
            config_yaml=config_yaml,
            keep_last=t.keep_last,
        )
        last_saved = at_step

    t_run = time.perf_counter()
    interrupted = False
    try:
        with stop.installed(display):
            for step in range(start_step + 1, t.steps + 1):
                t0 = time.perf_counter()
                rows = [next(rows_iter) for _ in range(P)]
                rows, shot_frac = few_shot.apply(rows, step)
                prompt_ids = encode_prompts(
                    rows,
                    tok,
                    system_prompt=system_prompt,
                    use_chat_template=cfg.data.use_chat_template,
                    max_prompt_length=cfg.data.max_prompt_length,
                )

                # 1. sample G completions per prompt
                ro = sample(policy, tok, prompt_ids, cfg, step)
                t1 = time.perf_counter()

                # 2. score them
                prompts = [row["prompt"] for row in rows for _ in range(G)]
                columns = {**columns_for(rows, G), "completion_ids": completion_id_lists(ro)}
                progress = reward_state(task, step, t.steps, P, G)
                scores = score_rewards(
                    reward_specs,
                    prompts,
                    ro.completion_text,
                    columns,
                    on_error=t.on_reward_error,
                    trainer_state=progress,
                )
                if acc_in_mix:
                    acc_values = scores.per_fn[acc.name]
                else:
                    acc_values = score_rewards(
                        [acc],
                        prompts,
                        ro.completion_text,
                        columns,
                        on_error="zero",
                        trainer_state=progress,
                    ).per_fn[acc.name]
                t2 = time.perf_counter()

                # 3. group-relative advantages, one scalar per completion
                rewards = scores.total.view(P, G).to(torch.float32)
                adv = group_advantages(
                    rewards, scale=cfg.algo.advantage_scale, baseline=cfg.algo.advantage_baseline
                ).reshape(N)
                input_ids, attention_mask, cmask = ro.training_batch(tok.pad_token_id)
                truncated = torch.tensor([f == "length" for f in ro.finish_reason])
                if cfg.algo.mask_truncated_completions:
                    cmask = cmask * (~truncated).unsqueeze(1).to(cmask.dtype)
                dev = models.device
                batch = (input_ids.to(dev), attention_mask.to(dev), cmask.to(dev))
                adv = adv.to(dev)

                # 4. reference log-probs for the KL term
                micro = min(cfg.optim.micro_batch_size, mini)
                ref_lp = ref_logprobs(models, batch, cfg, torch.arange(N, device=dev), micro)
                t3 = time.perf_counter()

                # 5. policy update
                if critic is None:
                    upd = update(models, optimizer, scheduler, batch, adv, ref_lp, cfg, step)
                else:  # PPO: token-level GAE advantages from the critic replace the group ones
                    upd = ppo.ppo_step(
                        models, critic, optimizer, scheduler, batch, scores.total, ref_lp, cfg, step
                    )
                t4 = time.perf_counter()

                # 6. metrics, samples, eval, checkpoint
                gen_tokens = int(ro.completion_mask.sum().item())
                lens = ro.completion_mask.sum(dim=1)
                std = torch.nan_to_num(rewards, nan=0.0).std(dim=1)
                m = {
                    "step": step,
                    **scores.metrics(),
                    "reward/accuracy": acc_values.nan_to_num(0.0).mean().item(),
                    "rollout/len_mean": lens.float().mean().item(),
                    "rollout/len_max": lens.max().item(),
                    "rollout/frac_truncated": truncated.float().mean().item(),
                    "rollout/frac_zero_std_groups": (std < 1e-6).float().mean().item(),
                    "advantage/std": adv.std().item(),
                    **({"curriculum/few_shot_frac": shot_frac} if few_shot.k else {}),
                    **upd,
                    "time/generate_s": t1 - t0,
                    "time/reward_s": t2 - t1,
                    "time/ref_s": t3 - t2,
                    "time/update_s": t4 - t3,
                    "perf/tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
                    "perf/train_tokens_per_s": gen_tokens
                    * cfg.algo.num_iterations
                    / max(t4 - t3, 1e-9),
                }
                if t.log_samples:
                    for pi in range(min(t.log_samples, P)):
                        sl = slice(pi * G, (pi + 1) * G)
                        samples_log.write(
                            {
                                "step": step,
                                "prompt": rows[pi]["prompt"],
                                "answer": rows[pi].get("answer"),
                                "completions": ro.completion_text[sl],
                                "rewards": scores.total[sl].tolist(),
                                "advantages": adv[sl].tolist(),
                                "finish_reason": ro.finish_reason[sl],
                                **scores.sample_fields(sl),
                            }
                        )
                if eval_rows and t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    m.update({f"eval/{k}": v for k, v in run_eval(step).items()})
                m["time/step_s"] = time.perf_counter() - t0
                metrics_log.write(m)
                display.update(step, m)
                if t.save_every and step % t.save_every == 0:
                    save(step)
                if stop.requested:
                    interrupted = True
                    break
    except KeyboardInterrupt:
        interrupted = True
        step -= 1  # the step in flight did not finish; the last complete one is saved below
    finally:
        display.close()

    done_step = step if step >= start_step else start_step
    if done_step > last_saved and done_step > 0:
        save(done_step)
    if interrupted:
        metrics_log.close()
        samples_log.close()
        display.print(
            f"interrupted: checkpoint saved at step {done_step} in {run_dir}; "
            f"continue with: peergrade train --resume {run_dir}",
            always=True,
        )
        return {"interrupted": True, "step": done_step, "run_dir": str(run_dir)}

    metrics_log.close()
    samples_log.close()
    wall = time.perf_counter() - t_run
    before = state["eval_before"]
    if not eval_rows:
        display.print(f"run directory: {run_dir}   ({wall:.0f} s)")
        return {"interrupted": False, "step": t.steps, "run_dir": str(run_dir), "wall_s": wall}
    display.print("evaluating the trained model on the held-out split ...")
    after = run_eval(t.steps)
    with JsonlWriter(run_dir / "metrics.jsonl") as log:
        log.write({"step": t.steps, **{f"eval/{k}": v for k, v in after.items()}, "final": True})
    k = t.eval_samples
    display.table(
        f"held-out accuracy ({before['n']} problems)",
        ["metric", "before", "after", "change"],
        [
            [
                name,
                f"{before[name]:.3f}",
                f"{after[name]:.3f}",
                f"{after[name] - before[name]:+.3f}",
            ]
            for name in ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS)
            if name in before and name in after
        ],
    )
    display.print(f"run directory: {run_dir}   ({wall:.0f} s training)")
    return {
        "interrupted": False,
        "step": t.steps,
        "run_dir": str(run_dir),
        "eval_before": before,
        "eval_after": after,
        "wall_s": wall,
    }
