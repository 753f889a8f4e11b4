"""Failure-mode detectors: read each step's metrics, say what went wrong and what to try.

``Detectors.update(metrics)`` is called once per logged metrics line (the step's metrics, the
starting evaluation too) and returns the keys to add to that line:

- ``alert/<name>: 1.0`` for every detector that is active on this step (absent otherwise), so
  the alerts plot and filter like any other metric in TensorBoard / W&B / the report;
- ``alerts: {<name>: <message>}`` with the same names: one sentence of what was seen (with the
  numbers) and what to try. It repeats on every step the alert stays active.

The detectors (names as in ``alert/<name>``; thresholds in ``train.alerts``):

=================  ============================================================================
no_signal          (a) ``rollout/frac_zero_std_groups`` >= ``zero_signal_frac`` on each of the
                   last ``window`` steps: most groups score all-equal, so advantages are 0
                   (the message counts a judge reward's unscored answers, ``judge/unscored``)
reward_vs_eval     (b) between two held-out evaluations accuracy fell by >= ``eval_drop`` while
                   the training reward rose by >= ``reward_rise``; or, since the first
                   evaluation, the training reward rose by >= ``reward_rise`` while held-out
                   accuracy did not rise at all (a judge pleased while an independent
                   held-out scorer, ``train.eval_reward``, stays put), the training reward
                   read on the held-out answers themselves when the evaluation reports it
                   (``eval/train_reward``: the judge's held-out score); active until the next
                   eval
reward_imbalance   (b) one reward function is saturated (batch std ~0, mean above its start) while
                   another fell >= ``component_drop`` below its best ``window``-step mean
length_collapse    (b) the ``window``-step mean completion length fell below ``length_collapse``
                   times its best ``window``-step mean
length_cap         (b) ``rollout/frac_truncated`` >= ``truncated_frac`` on each of the last
                   ``window`` steps
repetition         (b) ``rollout/repetition`` (repeated n-gram share, ``repetition_rate``) has a
                   ``window``-step mean >= ``repetition`` and rose >= ``repetition`` / 2 since
                   the first window
entropy_collapse   (c) the ``window``-step mean of ``entropy/mean`` fell below
                   ``entropy_collapse`` times the first window's
kl_blowup          (d) ``kl/mean`` > ``kl_max`` on this step
ratio_blowup       (d) ``ratio/max`` (largest per-token importance ratio) > ``ratio_max``
bf16_update        (d) on the first step under bf16 autocast, the bf16 casts of the weights moved
                   more than ``bf16_step_max`` times as far as the float32 weights
                   (``precision/bf16_step_ratio``, ``peergrade.training.precision``)
tools_always_fail  (f) every tool call failed (``tools/failure_frequency`` 1 with calls made) on
                   each of the last ``window`` steps
harness_failing    (f) ``harness/failed`` (the share of the step's episodes whose harness raised,
                   timed out, returned no number or never called the server, each scored 0)
                   >= ``harness_failed_frac`` on this step; the message counts them
                   (``harness/failed_episodes`` of ``harness/episodes``) and quotes the most
                   common error (``harness/top_error``)
judge_failing      (f) a judge reward counted this step as failing (``judge/failed_steps`` >= 1:
                   at least its ``fail_share`` of the answers unscored, each abstaining); the
                   message counts them (``judge/unscored``, ``judge/unscored_share``) and the
                   failing steps in a row (the judge stops the run at its ``max_failed_steps``)
nonfinite          (e) the loss or gradient norm was NaN/inf: ``update/nonfinite_frac`` > 0 (the
                   trainer skipped those optimizer steps; parameters untouched) -- the message
                   counts the skipped steps so far, also logged as ``update/skipped_total``
=================  ============================================================================

Pure Python over metric dicts: no torch, no model code, no I/O, no config import (the settings
object only needs the attributes of ``config.AlertConfig``). It decides nothing about the run:
training continues whatever fires; the user reads the alert and acts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

ALERT_NAMES = (
    "no_signal",
    "reward_vs_eval",
    "reward_imbalance",
    "length_collapse",
    "length_cap",
    "repetition",
    "entropy_collapse",
    "kl_blowup",
    "ratio_blowup",
    "bf16_update",
    "tools_always_fail",
    "harness_failing",
    "judge_failing",
    "nonfinite",
)

# held-out accuracy, in order of preference: sampled pass@1 averages k samples per problem, so
# it moves less by chance than greedy
EVAL_KEYS = ("eval/pass@1_sampled", "eval/pass@1_greedy")
#: the training reward's mean on the held-out answers, greedy and sampled
#: (``training.held_out.held_out_train_rewards``); their mean is the held-out training reward
HELD_REWARD_KEYS = ("eval/train_reward", "eval/train_reward_sampled")


def repetition_rate(token_lists: Iterable[Sequence[int]], n: int = 4) -> float:
    """Mean over completions of the share of repeated n-grams: 1 - distinct / total n-grams.

    0 for text with no n-gram seen twice, near 1 for a loop ("the the the ..."). Completions
    shorter than n + 1 tokens count as 0 (too short to repeat)."""
    rates = []
    for ids in token_lists:
        ids = list(ids)
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        rates.append(1.0 - len(set(grams)) / len(grams) if len(grams) >= 2 else 0.0)
    return sum(rates) / len(rates) if rates else 0.0


def _num(m: dict, key: str) -> float | None:
    """A finite number under ``key``, else None (missing, null in JSON, NaN, inf, non-numeric)."""
    v = m.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


class _Series:
    """One metric's recent values, its first-window mean and its best window mean so far."""

    def __init__(self, window: int):
        self.window = window
        self.recent: deque[float] = deque(maxlen=window)
        self.first: float | None = None  # mean of the first `window` values
        self.peak: float | None = None  # highest `window`-value mean seen
        self.floor: float | None = None  # lowest `window`-value mean seen

    def add(self, v: float | None) -> None:
        if v is None:
            return
        self.recent.append(v)
        if len(self.recent) == self.window:
            w = self.mean
            if self.first is None:
                self.first = w
            self.peak = w if self.peak is None else max(self.peak, w)
            self.floor = w if self.floor is None else min(self.floor, w)

    @property
    def full(self) -> bool:
        return len(self.recent) == self.window

    @property
    def mean(self) -> float:
        return _mean(self.recent)


class Detectors:
    """Stateful: feed every metrics line in step order (``update``), or replay a run's lines
    on resume (``replay``) so that windows and counters continue where they were."""

    def __init__(self, settings: Any, updates_per_step: int = 1):
        self.s = settings
        self.updates_per_step = updates_per_step  # optimizer steps per training step
        self.w = max(1, int(settings.window))
        self.steps = 0
        self.skipped_total = 0.0
        self.series: dict[str, _Series] = {}
        # consecutive steps each persistent condition has held
        self.streak: dict[str, int] = {"no_signal": 0, "length_cap": 0, "tools_always_fail": 0}
        # (step, accuracy, train-reward window mean) at each held-out evaluation
        self.evals: list[tuple[int, float, float | None]] = []
        # (step, the training reward on the held-out answers) at each evaluation reporting it
        self.held_rewards: list[tuple[int, float]] = []
        self.eval_alert: str | None = None

    # -------------------------------------------------------------------------- plumbing

    def _series(self, key: str) -> _Series:
        if key not in self.series:
            self.series[key] = _Series(self.w)
        return self.series[key]

    def replay(self, lines: Iterable[dict]) -> None:
        """Feed past metrics lines (e.g. metrics.jsonl on resume), discarding their alerts."""
        for m in lines:
            self.update(m)

    def update(self, m: dict) -> dict[str, Any]:
        """The ``alert/<name>`` and ``alerts`` keys for metrics line ``m`` (empty: nothing fired)."""
        if not getattr(self.s, "enabled", True):
            return {}
        is_step = any(k.startswith(("rollout/", "reward/", "loss/")) for k in m)
        alerts: dict[str, str] = {}
        extra: dict[str, Any] = {}
        if is_step:
            self.steps += 1
            for key in (
                "reward/total/mean",
                "rollout/len_mean",
                "rollout/repetition",
                "entropy/mean",
            ):
                self._series(key).add(_num(m, key))
            for fn in self._reward_fns(m):
                self._series(f"reward/{fn}/mean").add(_num(m, f"reward/{fn}/mean"))
                self._series(f"reward/{fn}/std").add(_num(m, f"reward/{fn}/std"))
            for check in (
                self._no_signal,
                self._reward_imbalance,
                self._length,
                self._repetition,
                self._entropy,
                self._blowup,
                self._bf16_update,
                self._tools_always_fail,
                self._harness_failing,
                self._judge_failing,
            ):
                alerts.update(check(m))
            nf = self._nonfinite(m)
            alerts.update(nf)
            if self.skipped_total:
                extra["update/skipped_total"] = self.skipped_total
        alerts.update(self._reward_vs_eval(m))
        if not alerts:
            return extra
        return {
            **extra,
            **{f"alert/{name}": 1.0 for name in alerts},
            "alerts": alerts,
        }

    @staticmethod
    def _reward_fns(m: dict) -> list[str]:
        return [
            k[len("reward/") : -len("/mean")]
            for k in m
            if k.startswith("reward/") and k.endswith("/mean") and k != "reward/total/mean"
        ]

    # -------------------------------------------------------------------------- (a)

    def _no_signal(self, m: dict) -> dict[str, str]:
        frac = _num(m, "rollout/frac_zero_std_groups")
        hit = frac is not None and frac >= self.s.zero_signal_frac
        self.streak["no_signal"] = self.streak["no_signal"] + 1 if hit else 0
        if self.streak["no_signal"] < self.w:
            return {}
        std, mean = _num(m, "reward/total/std"), _num(m, "reward/total/mean")
        if std is not None and std < 1e-9 and mean is not None:
            seen = f"every completion of this step scored {mean:.3g}"
        else:
            seen = f"{frac:.0%} of groups scored all-equal rewards"
        unscored = _num(m, "judge/unscored")  # a judge reward's unscorable answers
        fallbacks = _num(m, "judge/fallbacks")
        if fallbacks:
            seen += (
                f" ({fallbacks:.0f} answers got the judge's fallback_score: its replies were "
                "not the JSON asked for, or its endpoint failed; see judge/failed_requests)"
            )
        elif unscored:
            seen += (
                f" ({unscored:.0f} answers the judge could not score abstained: its replies "
                "were not the JSON asked for, or its endpoint failed; see judge/failed_requests)"
            )
        return {
            "no_signal": (
                f"no learning signal: {seen}, for {self.streak['no_signal']} steps in a row "
                f"(threshold {self.s.zero_signal_frac:.0%} for {self.w} steps), so the "
                "advantages are 0 and the policy does not move. Try: easier prompts or a "
                "curriculum (data.few_shot), a larger rollout.group_size, a higher "
                "rollout.temperature, or a denser reward (partial credit, a format reward)."
            )
        }

    # -------------------------------------------------------------------------- (b)

    def _reward_vs_eval(self, m: dict) -> dict[str, str]:
        acc = next((v for k in EVAL_KEYS if (v := _num(m, k)) is not None), None)
        if acc is not None:
            r = self.series.get("reward/total/mean")
            reward = r.mean if r is not None and r.recent else None
            step = int(m.get("step", self.steps))
            self.eval_alert = None
            if self.evals:
                prev_step, prev_acc, prev_reward = self.evals[-1]
                if prev_reward is None:  # the starting eval: compare with the first window
                    prev_reward = r.first if r is not None else None
                rise = None if reward is None or prev_reward is None else reward - prev_reward
                drop = prev_acc - acc
                if drop >= self.s.eval_drop and rise is not None and rise >= self.s.reward_rise:
                    self.eval_alert = (
                        f"possible reward hacking: the training reward rose by {rise:+.3f} "
                        f"(window mean) while held-out accuracy fell from {prev_acc:.3f} "
                        f"(step {prev_step}) to {acc:.3f} (step {step}). Read the completions "
                        "in samples.jsonl for answers that game the reward; try a stricter "
                        "verifier, a KL penalty (algo.beta), or a lower optim.lr."
                    )
                else:
                    self.eval_alert = self._pleased(acc, step, m) or self._stalled(
                        acc, step, reward, r
                    )
            self.evals.append((step, acc, reward))
            held = [v for key in HELD_REWARD_KEYS if (v := _num(m, key)) is not None]
            if held and not self.held_rewards:  # the first evaluation that reports it
                self.held_rewards.append((step, sum(held) / len(held)))
        return {"reward_vs_eval": self.eval_alert} if self.eval_alert else {}

    def _pleased(self, acc: float, step: int, m: dict) -> str | None:
        """The second case read on the held-out answers themselves: since the first evaluation
        the training reward's held-out score (``HELD_REWARD_KEYS``, the mean of greedy and
        sampled) rose by >= ``reward_rise`` while the held-out scorer did not rise at all. A
        judge's score can climb on held-out prompts while its training window stays flat
        (few, noisy steps), so this does not wait for the window."""
        held = [v for key in HELD_REWARD_KEYS if (v := _num(m, key)) is not None]
        if not held or not self.held_rewards:
            return None
        first_step, first = self.held_rewards[0]
        start_step, start_acc, _ = self.evals[0]
        rise = sum(held) / len(held) - first
        if rise < self.s.reward_rise or acc > start_acc or start_acc >= 1.0 - 1e-9:
            return None
        return (
            f"possible reward hacking: on the held-out prompts the training reward rose by "
            f"{rise:+.3f} (eval/train_reward, greedy and sampled) since step {first_step} while "
            f"the held-out score did not rise: {start_acc:.3f} (step {start_step}) -> "
            f"{acc:.3f} (step {step}). The held-out scorer (train.eval_reward) is independent "
            "of the training reward: the policy is learning what pleases the reward, not the "
            "property it stands for; read samples.jsonl, audit the reward (peergrade audit), "
            "try a KL penalty (algo.beta)."
        )

    def _stalled(self, acc: float, step: int, reward: float | None, r) -> str | None:
        """The second case of reward_vs_eval: since the first evaluation the training reward
        rose by >= ``reward_rise`` while the held-out score did not rise at all (and had room
        to): a judge's score climbing while an independent held-out measure stays put."""
        start_step, start_acc, start_reward = self.evals[0]
        if start_reward is None:  # the starting eval: the first window of the reward
            start_reward = r.first if r is not None else None
        if reward is None or start_reward is None or start_acc >= 1.0 - 1e-9:
            return None
        rise = reward - start_reward
        if rise < self.s.reward_rise or acc > start_acc:
            return None
        return (
            f"possible reward hacking: the training reward rose by {rise:+.3f} (window mean) "
            f"since the first evaluation while the held-out score did not rise: "
            f"{start_acc:.3f} (step {start_step}) -> {acc:.3f} (step {step}). With a held-out "
            "scorer independent of the training reward (train.eval_reward), the policy is "
            "learning what pleases the reward, not the property it stands for; read "
            "samples.jsonl, audit the reward (peergrade audit), try a KL penalty (algo.beta)."
        )

    def _reward_imbalance(self, m: dict) -> dict[str, str]:
        fns = self._reward_fns(m)
        if len(fns) < 2:
            return {}
        saturated, collapsed = [], []
        for fn in fns:
            mean, std = self.series[f"reward/{fn}/mean"], self.series[f"reward/{fn}/std"]
            if not (mean.full and std.full):
                continue
            if max(std.recent) <= 1e-6 and mean.first is not None and mean.mean > mean.first:
                saturated.append(f"{fn} (every sample {mean.recent[-1]:.3g})")
            elif mean.peak is not None and mean.peak - mean.mean >= self.s.component_drop:
                collapsed.append(f"{fn} ({mean.peak:.3f} -> {mean.mean:.3f})")
        if not (saturated and collapsed):
            return {}
        return {
            "reward_imbalance": (
                f"possible reward hacking: {', '.join(saturated)} saturated while "
                f"{', '.join(collapsed)} collapsed ({self.w}-step means). The policy may be "
                "maximising the easy reward at the cost of the other; try re-weighting the "
                "rewards, capping or gating the saturated one on the other (e.g. format only "
                "counts with a correct answer), and read samples.jsonl."
            )
        }

    def _length(self, m: dict) -> dict[str, str]:
        out: dict[str, str] = {}
        trunc = _num(m, "rollout/frac_truncated")
        hit = trunc is not None and trunc >= self.s.truncated_frac
        self.streak["length_cap"] = self.streak["length_cap"] + 1 if hit else 0
        if self.streak["length_cap"] >= self.w:
            out["length_cap"] = (
                f"completions hit the length cap: {trunc:.0%} were truncated on this step, "
                f">= {self.s.truncated_frac:.0%} for {self.streak['length_cap']} steps in a "
                "row. Cut answers score badly or pad the reward; try a larger "
                "rollout.max_completion_length, a stop string (rollout.stop), a length "
                "penalty, or algo.mask_truncated_completions."
            )
        s = self.series.get("rollout/len_mean")
        if s is not None and s.full and s.peak and s.mean < self.s.length_collapse * s.peak:
            out["length_collapse"] = (
                f"completion length collapsed: the {self.w}-step mean is {s.mean:.1f} tokens, "
                f"below {self.s.length_collapse:.0%} of its best {s.peak:.1f}. Short answers "
                "can game a reward that does not check the work; read samples.jsonl, and try "
                "a stricter verifier or a lower optim.lr."
            )
        return out

    def _repetition(self, m: dict) -> dict[str, str]:
        s = self.series.get("rollout/repetition")
        if s is None or not s.full or s.first is None:
            return {}
        lim = self.s.repetition
        if s.mean >= lim and s.mean - s.first >= lim / 2:
            return {
                "repetition": (
                    f"repetition rising: {s.mean:.0%} of each completion's 4-grams are "
                    f"repeats ({self.w}-step mean), up from {s.first:.0%}. Loops can farm a "
                    "per-token or length reward; try a repetition penalty reward, a lower "
                    "optim.lr, or a KL penalty (algo.beta)."
                )
            }
        return {}

    # -------------------------------------------------------------------------- (c), (d)

    def _entropy(self, m: dict) -> dict[str, str]:
        s = self.series.get("entropy/mean")
        if s is None or not s.full or not s.first or s.first <= 0:
            return {}
        if s.mean < self.s.entropy_collapse * s.first:
            return {
                "entropy_collapse": (
                    f"entropy collapsed: the {self.w}-step mean is {s.mean:.3g} nats/token, "
                    f"below {self.s.entropy_collapse:.0%} of its start {s.first:.3g}. The "
                    "group's completions become identical and stop giving signal; try a "
                    "higher rollout.temperature, a lower optim.lr, algo.clip_eps_high "
                    "(clip-higher), or a KL penalty (algo.beta)."
                )
            }
        return {}

    def _blowup(self, m: dict) -> dict[str, str]:
        out: dict[str, str] = {}
        kl = _num(m, "kl/mean")
        if kl is not None and kl > self.s.kl_max:
            out["kl_blowup"] = (
                f"KL blow-up: kl/mean is {kl:.3g}, above {self.s.kl_max:g}: the policy has "
                "moved far from the reference. Try a lower optim.lr, a larger algo.beta, "
                "tighter optim.max_grad_norm, or resume from an earlier checkpoint."
            )
        ratio = _num(m, "ratio/max")
        if ratio is not None and ratio > self.s.ratio_max:
            out["ratio_blowup"] = (
                f"importance-ratio blow-up: the largest per-token ratio pi/pi_old is "
                f"{ratio:.3g}, above {self.s.ratio_max:g}: updates within one batch move the "
                "policy too far. Try fewer algo.num_iterations, a lower optim.lr, or a "
                "smaller optim.max_grad_norm."
            )
        return out

    def _bf16_update(self, m: dict) -> dict[str, str]:
        ratio = _num(m, "precision/bf16_step_ratio")
        limit = getattr(self.s, "bf16_step_max", 3.0)
        if ratio is None or ratio <= limit:
            return {}
        ties = _num(m, "precision/bf16_tie_frac") or 0.0
        return {
            "bf16_update": (
                f"bf16 autocast moved the model {ratio:.3g}x as far as the update moved the "
                f"float32 weights on the first step (above {limit:g}): the effective step is "
                f"far above optim.lr. {ties:.1%} of the weights sit exactly halfway between two "
                "bfloat16 values (typical of a de-quantised GGUF), so any update tips them all "
                "the way it pushes. Try model.autocast: off, or convert the model again with "
                "`peergrade convert` (which rounds those ties)."
            )
        }

    # -------------------------------------------------------------------------- (f)

    def _tools_always_fail(self, m: dict) -> dict[str, str]:
        calls, fails = _num(m, "tools/call_frequency"), _num(m, "tools/failure_frequency")
        hit = bool(calls) and fails is not None and fails >= 1.0
        self.streak["tools_always_fail"] = self.streak["tools_always_fail"] + 1 if hit else 0
        if self.streak["tools_always_fail"] < self.w:
            return {}
        return {
            "tools_always_fail": (
                f"every tool call failed for {self.streak['tools_always_fail']} steps in a row "
                f"({calls:.2g} calls per episode): the model learns that calling does not pay. "
                "Read the tool turns in samples.jsonl for the cause (a malformed call format, "
                "a tool that raises on every input); try a template that shows the tools, a "
                "warm-up on the call format, or a longer env.tool_timeout."
            )
        }

    def _harness_failing(self, m: dict) -> dict[str, str]:
        share = _num(m, "harness/failed")
        limit = getattr(self.s, "harness_failed_frac", 0.25)
        if not share or share < limit:
            return {}
        failed, total = _num(m, "harness/failed_episodes"), _num(m, "harness/episodes")
        counted = (
            f"{failed:.0f}/{total:.0f} episodes" if failed and total else f"{share:.0%} of episodes"
        )
        top, times = m.get("harness/top_error"), _num(m, "harness/top_error_count")
        seen = ""
        if isinstance(top, str) and top:
            seen = f": {top}" if times is None else f": {top} ({times:.0f}x, the most common)"
        return {
            "harness_failing": (
                f"{counted} failed on this step{seen}. A failed episode scores 0 whatever the "
                f"model did (threshold {limit:.0%}). Every episode's error is in samples.jsonl "
                "(extra.harness_error); try a longer harness.timeout_s, a lower "
                "harness.concurrency, or run the harness by hand against `peergrade serve`."
            )
        }

    def _judge_failing(self, m: dict) -> dict[str, str]:
        streak = _num(m, "judge/failed_steps")
        if not streak:
            return {}
        unscored, share = _num(m, "judge/unscored"), _num(m, "judge/unscored_share")
        counted = (
            f"{unscored:.0f} answers ({share:.0%})" if unscored is not None and share else "most"
        )
        return {
            "judge_failing": (
                f"the judge could not score {counted} of this step's answers "
                f"({streak:.0f} failing step(s) in a row): they abstain (advantage 0), so the "
                "step teaches little or nothing. The judge printed why when this began; each "
                "answer's reason is in samples.jsonl (extra.judge_error). Try `peergrade audit "
                "--config ...` on the judge, and check that its endpoint or model is up; the "
                "run stops at the judge's max_failed_steps."
            )
        }

    # -------------------------------------------------------------------------- (e)

    def _nonfinite(self, m: dict) -> dict[str, str]:
        frac = _num(m, "update/nonfinite_frac")
        bad_keys = [
            k
            for k in ("loss/policy", "grad/norm")
            if k in m and (m[k] is None or (isinstance(m[k], float) and not math.isfinite(m[k])))
        ]
        if not frac and not bad_keys:
            return {}
        if frac:
            self.skipped_total += max(1, round(frac * self.updates_per_step))
        seen = ", ".join(bad_keys) + " non-finite" if bad_keys else "a non-finite gradient"
        return {
            "nonfinite": (
                f"non-finite loss or gradients: {seen} on this step; "
                f"{(frac or 0.0):.0%} of its optimizer steps were skipped with the parameters "
                f"untouched ({self.skipped_total:g} skipped so far). Try a lower optim.lr, "
                "optim.max_grad_norm > 0, model.dtype float32 (bf16/fp16 overflow), and check "
                "the reward functions for NaN/inf values."
            )
        }
