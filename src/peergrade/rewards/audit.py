"""Attack reward functions with the completions a policy finds, before training (``peergrade audit``).

GRPO is only as good as its verifier: a reward function that pays for a completion that is not
a solution (several candidate answers, a format tag with nothing behind it, code that exits
before its tests) gets that completion learned. Every such exploit is a string we can score in
milliseconds, so this module builds a battery of them per dataset row and scores it with the
reward functions exactly as training would (``rewards.score_rewards``: TRL's calling contract,
conversational completions, async functions, the same checks on what comes back).

Per row (``RowContext``): the reference answer (the ``answer``, ``solution`` or
``ground_truth`` column), the tests of a code row, and:

- the *correct* completion, written in several common forms (R1 ``<think>``/``<answer>``
  blocks, a bare ``<answer>`` tag, ``\\boxed{}``, a last line, the bare answer; for code a
  fenced block or bare code; the row's reference solution). A function's correct score on a
  row is its best score over these forms; the exploits are written in the form the weighted
  total likes best on that row (so a function that insists on tags is attacked with tags);
- a plainly *wrong* completion (a wrong answer in that form) and a nonsense one: the lowest of
  the references' scores is the row's *floor*.

An exploit *wins* a row for a function when it scores at least as well as the correct
completion (an exploit that adds text to a correct answer, ``padded_answer``, must score more)
and above the floor (a function that pays the same for everything is not falling for
anything). Some exploits are a set of guesses (the answer first, in the middle, last): they win
only when every variant wins, since a model cannot know which of its guesses is the right one.
A function whose wrong completion scores as well as the correct one on most rows does not read
answers (a format or shaping reward): the answer-shaped exploits do not apply to it, and
exploits that keep the right answer but skip the work (an empty think block, padding) do. With
several functions, the weighted total (what training optimises) is audited too, and a shaping
function is judged through it. An exploit is a finding when it wins on at least ``fail_share``
of the rows (default ``DEFAULT_FAIL_SHARE``); a function that raises or returns NaN on a
completion the contract says it scores is *fragile*. Lookalikes of the answer (``42.0``,
``042``, full-width digits, words) and out-of-contract inputs (``None``, a number, the other
completion form) are information only.

``samples_audit`` re-examines a finished run's ``samples.jsonl``: the completions with high
reward that a stricter cross-check disagrees with (math-verify equivalence of the strictly
extracted answer, several distinct answers, repetition, cut at the length cap, the prompt
echoed), ranked, with their prompts.

``at_startup`` is the trainer's ``train.audit_rewards`` hook: a small battery before the
model loads, one line per exploitable function (a judge reward gets its own probes instead,
``judge_audit.startup_audit``, within ``train.audit_judge_requests``; one line per judge); a function that returns no list of one score
per completion stops the run there (``AuditError``), whatever the mode but ``off``.

The battery (rows and exploits) is ``rewards.audit_battery`` and the samples audit
``rewards.audit_samples``; this module is the engine that runs the battery and the report, and
re-exports the names users import (``EXPLOITS``, ``cross_check``, ``samples_audit``, ...).

This module does not load or run a model (completion ids are approximated, one id per word or
punctuation mark), does not change a reward function, and imports neither the trainer nor
model code.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from peergrade.rewards.audit_battery import (  # the battery: rows and exploits
    _EPS,
    _FORMS,
    _NONSENSE,
    _PLAIN_FORMS,
    EXPLOITS,
    PROBES,
    AuditError,
    Exploit,
    RowContext,
    _code_info,
    _correct_texts,
    _wrong_text,
    row_contexts,
)
from peergrade.rewards.audit_samples import (  # re-exported: the samples audit
    REPETITION_FLAG,
    cross_check,
    format_samples,
    samples_audit,
)
from peergrade.rewards.extract import completion_text
from peergrade.rewards.registry import (
    RewardSpec,
    TrainerState,
    columns_for,
    score_rewards,
)

__all__ = [
    "DEFAULT_FAIL_SHARE",
    "EXPLOITS",
    "REPETITION_FLAG",
    "AuditError",
    "AuditReport",
    "Exploit",
    "at_startup",
    "audit_rewards",
    "cross_check",
    "format_samples",
    "samples_audit",
]

#: an exploit that wins on at least this share of the rows is a finding (below it: a
#: coincidence on a few rows, e.g. an operand that happens to equal the answer)
DEFAULT_FAIL_SHARE = 0.1
#: rows the start-up audit (``train.audit_rewards``) attacks
STARTUP_ROWS = 16
#: ... and when the rows are code rows (each exploit is a sandboxed process)
STARTUP_CODE_ROWS = 4
#: rows a judge reward's start-up audit may use (``train.audit_judge_requests`` cuts them)
STARTUP_JUDGE_ROWS = 8
#: equivalent forms are information only: scored on at most this many rows (math-verify
#: takes tens of milliseconds to reject "forty-two")
INFO_ROWS = 10


# ----------------------------------------------------------------------------- scoring


_TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")


def pseudo_ids(completion) -> list[int]:
    """Stand-in completion ids (no tokenizer here): one id per word, punctuation mark or run
    of whitespace, so length and repetition rewards see a plausible token count."""
    try:
        text = completion_text(completion)
    except TypeError:
        return []
    return list(_ids_of(text))


@functools.lru_cache(maxsize=4096)
def _ids_of(text: str) -> tuple[int, ...]:
    return tuple(zlib.crc32(t.encode()) % 50_000 for t in _TOKEN_RE.findall(text))


_ERR_RE = re.compile(r"^reward (['\"])(.+?)\1 (?:sample (\d+):)?")


@dataclass
class _Scored:
    values: dict[str, list]  # name -> one float or None per completion (None: not scored)
    errors: dict[str, dict[int, str]]  # name -> {completion index: why}


#: id(spec) -> its timeout message: a function that hung is not called again in this audit
_TIMED_OUT: dict[int, str] = {}


def _score(specs, ctxs, row_of: list[int], completions: list, state: TrainerState) -> _Scored:
    """Every function on the batch through ``score_rewards`` (errors kept per sample)."""
    rows = [ctxs[i].row for i in row_of]
    columns = columns_for(rows, 1) if rows else {}
    columns["completion_ids"] = [pseudo_ids(c) for c in completions]
    prompts = [r.get("prompt", "") for r in rows]
    values: dict[str, list] = {}
    errors: dict[str, dict[int, str]] = {}
    for spec in specs:  # one call per function, so that one's failure never hides another's
        hung = _TIMED_OUT.get(id(spec))
        if hung is not None:  # it hung once: not called again (each call would wait as long)
            values[spec.name] = [None] * len(completions)
            errors[spec.name] = {i: hung for i in range(len(completions))}
            continue
        res = score_rewards(
            [spec], prompts, completions, columns, on_error="zero", trainer_state=state
        )
        if res.counts.get(f"reward/{spec.name}/timeouts"):
            _TIMED_OUT[id(spec)] = next(m for m in res.errors if "did not return within" in m)
        errs: dict[int, str] = {}
        for msg in res.errors:
            m = _ERR_RE.match(msg)
            if m and m.group(3) is not None:
                errs[int(m.group(3))] = msg
            elif m:
                errs.update({i: msg for i in range(len(completions))})
        vals = [None if math.isnan(v) else float(v) for v in res.per_fn[spec.name].tolist()]
        for i in errs:
            vals[i] = None
        values[spec.name], errors[spec.name] = vals, errs
    return _Scored(values, errors)


# ----------------------------------------------------------------------------- the report


@dataclass
class Finding:
    """One exploit against one function (or the weighted total)."""

    exploit: str
    kind: str
    status: str  # EXPLOIT, ERROR, ok, n/a, info
    mean: float | None  # mean score over the rows it applies to
    wins: int  # rows where it matched (or beat) the correct completion, above the floor
    rows: int  # rows it applies to
    errors: int = 0
    error: str | None = None
    example: str | None = None  # one winning completion (or the first one built)


@dataclass
class UnitReport:
    """The audit of one reward function, or of the weighted total (``name == "total"``)."""

    name: str
    weight: float
    reads_answers: bool
    judged: bool  # its verdict decides the exit status (shaping terms are judged via the total)
    correct_mean: float | None
    wrong_mean: float | None
    findings: list[Finding]
    verdict: str  # clean | exploitable | fragile | broken (it scored no completion at all)
    note: str = ""

    @property
    def worst(self) -> Finding | None:
        bad = [f for f in self.findings if f.status in ("EXPLOIT", "ERROR")]
        return max(
            bad, key=lambda f: (f.status == "EXPLOIT", f.wins / max(f.rows, 1)), default=None
        )


@dataclass
class AuditReport:
    units: list[UnitReport]
    rows: int
    fail_share: float
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Exit status 1: a judged unit is exploitable, or any function is fragile."""
        return any(
            (u.judged and u.verdict == "exploitable") or u.verdict in ("fragile", "broken")
            for u in self.units
        )

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "fail_share": self.fail_share,
            "seconds": round(self.seconds, 3),
            "failed": self.failed,
            "notes": self.notes,
            "functions": [asdict(u) for u in self.units],
        }

    def shape_errors(self) -> list[str]:
        """Per function that returned something other than one score per completion (a
        wrong-length list, or no list at all), its first such message: a break of the calling
        contract whatever the completions, so training with it cannot start."""
        out = []
        for u in self.units:
            if u.name == "total":
                continue
            for f in u.findings:
                if f.error and _SHAPE_ERR_RE.search(f.error):
                    out.append(_SHAPE_ERR_RE.search(f.error).group(0))
                    break
        return out

    def lines(self) -> list[str]:
        """One line per exploitable or fragile unit, with its worst exploit (start-up)."""
        out = []
        for u in self.units:
            w = u.worst
            if u.verdict == "broken" and u.name != "total":
                out.append(f"reward audit: {u.name} is broken: {u.note}")
                continue
            if u.verdict == "clean" or w is None or u.verdict == "broken":
                continue
            what = (
                f"{w.exploit} scores as well as the correct answer on {w.wins}/{w.rows} rows"
                if w.status == "EXPLOIT"
                else f"{w.exploit} makes it fail on {w.errors}/{w.rows} rows ({w.error})"
            )
            tail = "" if u.judged else " (a shaping term: the total is what counts)"
            out.append(f"reward audit: {u.name} is {u.verdict}: {what}{tail}")
        return out

    def format(self, verbose: bool = False) -> str:
        """The tables: per function, the exploits that apply (all of them with ``verbose``)."""
        out = [
            f"reward audit: {self.rows} rows, {len(EXPLOITS)} exploits, fail share "
            f"{self.fail_share:g} ({self.seconds:.1f} s)"
        ]
        out += [f"note: {n}" for n in self.notes]
        for u in self.units:
            head = f"\n{u.name}" + (
                f" (weight {u.weight:g})" if u.name != "total" else " (weighted)"
            )
            cm = "-" if u.correct_mean is None else f"{u.correct_mean:.3f}"
            wm = "-" if u.wrong_mean is None else f"{u.wrong_mean:.3f}"
            out.append(f"{head}: correct {cm}, wrong {wm}; {u.note}".rstrip("; "))
            out.append(f"  {'exploit':<24} {'kind':<10} {'mean':>7} {'>=correct':>11}  status")
            for f in u.findings:
                if not verbose and f.status == "n/a":
                    continue
                mean = "-" if f.mean is None else f"{f.mean:.3f}"
                wins = f"{f.wins}/{f.rows}" if f.kind not in ("robustness",) else ""
                status = f.status + (f" ({f.errors} raised: {f.error[:70]})" if f.errors else "")
                out.append(f"  {f.exploit:<24} {f.kind:<10} {mean:>7} {wins:>11}  {status}")
            verdict = u.verdict.upper() if u.verdict != "clean" else "clean"
            w = u.worst
            extra = f": worst {w.exploit}" if w is not None else ""
            judged = "" if u.judged else " (shaping term, judged through the total)"
            out.append(f"  verdict: {verdict}{extra}{judged}")
            if w is not None and w.example is not None:
                out.append(f"  e.g. {json.dumps(w.example)[:200]}")
        broken = [u.name for u in self.units if u.verdict == "broken" and u.name != "total"]
        if broken:
            out.append(f"\nFAILED: {', '.join(broken)} scored no completion at all")
        elif any(u.judged and u.verdict == "exploitable" for u in self.units):
            out.append("\nFAILED: an exploit earns credit")
        elif self.failed:
            out.append("\nFAILED: a reward function fails on some completions")
        else:
            out.append("\nno exploit found")
        return "\n".join(out)


# ----------------------------------------------------------------------------- the audit


@dataclass
class _Audit:
    """One audit's fixed inputs: the functions, the rows, and the units it judges (each
    function, and the weighted ``total`` when there are several)."""

    specs: Sequence[RewardSpec]
    ctxs: list[RowContext]
    state: TrainerState
    names: list[str] = field(init=False)
    weights: dict[str, float] = field(init=False)
    unit_names: list[str] = field(init=False)

    def __post_init__(self):
        self.names = [s.name for s in self.specs]
        self.weights = {s.name: s.weight for s in self.specs}
        self.unit_names = self.names + (["total"] if len(self.specs) > 1 else [])

    @property
    def answers_known(self) -> bool:
        """Whether any row has a reference answer or tests (else no right or wrong completion
        can be written)."""
        return any(c.answer is not None or c.code for c in self.ctxs)

    def score(self, row_of: list[int], completions: list) -> _Scored:
        """``_score`` with this audit's functions, rows and trainer state."""
        return _score(self.specs, self.ctxs, row_of, completions, self.state)

    def total_of(self, vals: dict[str, list], i: int) -> float | None:
        got = [(self.weights[n], vals[n][i]) for n in self.names if vals[n][i] is not None]
        return sum(w * v for w, v in got) if got else None

    def unit_values(self, scored: _Scored) -> dict[str, list]:
        """Each unit's scores of a batch: the functions' own, and their weighted total."""
        vals = dict(scored.values)
        if len(self.specs) > 1:
            vals["total"] = [
                self.total_of(scored.values, i)
                for i in range(len(next(iter(scored.values.values()))))
            ]
        return vals

    def per_row(self) -> dict[str, list]:
        """Per unit, one unknown (None) per row."""
        return {u: [None] * len(self.ctxs) for u in self.unit_names}


@dataclass
class _Baselines:
    """What the references earned, per unit and row (None: not scored): the correct completion
    (its best form), the plain one (see ``_reference_scores``), the wrong one, and the floor
    (the lowest of the wrong, nonsense and correct scores); and which units read answers."""

    correct: dict[str, list]
    plain: dict[str, list]
    wrong: dict[str, list]
    floor: dict[str, list]
    reads: dict[str, bool]


def audit_rewards(
    specs: Sequence[RewardSpec],
    rows: Sequence[dict],
    *,
    fail_share: float = DEFAULT_FAIL_SHARE,
    max_steps: int = 1,
    code: bool = True,
) -> AuditReport:
    """Score the battery with ``specs`` on ``rows`` (see the module docstring)."""
    if not 0 < fail_share <= 1:
        raise ValueError(f"fail_share must be in (0, 1], got {fail_share}")
    if not specs:
        raise ValueError("audit: no reward function to audit")
    if not rows:
        raise ValueError("audit: no rows to build exploits from")
    t0 = time.perf_counter()
    _TIMED_OUT.clear()
    ctxs = row_contexts(rows)
    state = TrainerState(global_step=0, max_steps=max(1, max_steps), num_train_epochs=1)
    a = _Audit(specs, ctxs, state)
    notes = []
    if all(c.answer is None and not c.code for c in ctxs):
        notes.append(
            "the rows have no reference answer (answer/solution/ground_truth) and no tests: "
            "only the format and robustness exploits apply"
        )

    # 1. references: the correct completion in every form, a wrong one, nonsense
    ref, ref_row, correct, plain = _reference_scores(a)
    wrong, floor = _wrong_scores(a, correct)
    reads = _reads_answers(a, correct, wrong)
    base = _Baselines(correct, plain, wrong, floor, reads)
    shaping_in_mix = any(not reads[n] for n in a.names) and len(specs) > 1

    # 2. the exploits (one batch each: a function that raises on one exploit keeps the
    # others' scores), then the probes. A set of guesses is scored one variant at a time,
    # each on the rows where every variant so far won for some unit (it wins only if all do).
    findings = _correct_completion_findings(a, ref, ref_row)
    for ex in EXPLOITS:
        if ex.kind == "code" and not code:
            continue
        for u, f in _exploit_findings(a, ex, base, shaping_in_mix, fail_share).items():
            findings[u].append(f)
    for name, probe in PROBES:
        for u, f in _probe_findings(a, name, probe).items():
            findings[u].append(f)

    units = [_unit_report(a, u, base, findings[u]) for u in a.unit_names]
    return AuditReport(units, len(ctxs), fail_share, time.perf_counter() - t0, notes)


def _reference_scores(a: _Audit) -> tuple[_Scored, list[int], dict[str, list], dict[str, list]]:
    """The correct completion in every form, scored: the scores (and each one's row), and per
    unit and row the best correct score and the best plain one. Sets each row's ``best_form``,
    the form the weighted total likes best (the exploits are written in it)."""
    refs, ref_row, ref_form = [], [], []
    for c in a.ctxs:
        for j, text in enumerate(_correct_texts(c)):
            refs.append(text)
            ref_row.append(c.index)
            ref_form.append(j)
    ref = a.score(ref_row, refs)
    ref_vals = a.unit_values(ref)
    correct = a.per_row()
    # plain: the best the right answer earns with no reasoning at all (a bare tag or the bare
    # answer); an exploit that skips the work must beat it (a reward that never asked for a
    # think block is not fooled by an empty one)
    plain = a.per_row()
    best_total = [None] * len(a.ctxs)
    for k, (i, j) in enumerate(zip(ref_row, ref_form)):
        for u in a.unit_names:
            v = ref_vals[u][k]
            if v is not None and (correct[u][i] is None or v > correct[u][i]):
                correct[u][i] = v
            if v is not None and not a.ctxs[i].code and _FORMS[j][0] in _PLAIN_FORMS:
                plain[u][i] = v if plain[u][i] is None else max(plain[u][i], v)
        t = ref_vals[a.unit_names[-1]][k]
        if t is not None and (best_total[i] is None or t > best_total[i] + _EPS):
            best_total[i] = t
            a.ctxs[i].best_form = j
    return ref, ref_row, correct, plain


def _wrong_scores(a: _Audit, correct: dict[str, list]) -> tuple[dict[str, list], dict[str, list]]:
    """A wrong completion and a nonsense one per row, scored: per unit and row the wrong score,
    and the floor (the lowest of the wrong, nonsense and ``correct`` scores)."""
    base_row, base_text = [], []
    for c in a.ctxs:
        for text in (_wrong_text(c), _NONSENSE):
            if text is not None:
                base_row.append(c.index)
                base_text.append(text)
    base_vals = a.unit_values(a.score(base_row, base_text))
    wrong = a.per_row()
    floor = a.per_row()
    for u in a.unit_names:
        for k, i in enumerate(base_row):
            v = base_vals[u][k]
            if v is None:
                continue
            if base_text[k] != _NONSENSE:
                wrong[u][i] = v
            floor[u][i] = v if floor[u][i] is None else min(floor[u][i], v)
        for i in range(len(a.ctxs)):
            if correct[u][i] is not None:
                floor[u][i] = (
                    correct[u][i] if floor[u][i] is None else min(floor[u][i], correct[u][i])
                )
    return wrong, floor


def _reads_answers(a: _Audit, correct: dict[str, list], wrong: dict[str, list]) -> dict[str, bool]:
    """Per unit: it reads answers when the correct completion beats the wrong one on most rows."""
    reads: dict[str, bool] = {}
    for u in a.unit_names:
        pairs = [
            (cv, wv) for cv, wv in zip(correct[u], wrong[u]) if cv is not None and wv is not None
        ]
        reads[u] = bool(pairs) and sum(cv > wv + _EPS for cv, wv in pairs) > len(pairs) / 2
    return reads


def _correct_completion_findings(
    a: _Audit, ref: _Scored, ref_row: list[int]
) -> dict[str, list[Finding]]:
    """The first findings per unit: failing on the correct completion itself (``ref``), which
    makes a function fragile whatever else happens."""
    findings: dict[str, list[Finding]] = {u: [] for u in a.unit_names}
    for u in a.names:
        bad_rows = {ref_row[k]: m for k, m in ref.errors[u].items()}
        if bad_rows:
            first = _short_error(next(iter(bad_rows.values())))
            findings[u].append(
                Finding(
                    "correct_completion",
                    "robustness",
                    "ERROR",
                    None,
                    0,
                    len(a.ctxs),
                    len(bad_rows),
                    first,
                )
            )
    return findings


def _exploit_findings(
    a: _Audit, ex: Exploit, base: _Baselines, shaping_in_mix: bool, fail_share: float
) -> dict[str, Finding]:
    """How exploit ``ex`` did against each unit."""
    built = {}
    for c in a.ctxs:
        if ex.kind == "equivalent" and c.index >= INFO_ROWS:
            continue
        variants = ex.build(c)
        if variants:
            built[c.index] = variants
    bar = base.floor
    if ex.skips_work:
        bar = {
            u: [_max_known(f, p) for f, p in zip(base.floor[u], base.plain[u])]
            for u in a.unit_names
        }
    texts, per_row, vals, errs = _score_exploit(a, ex, built, base, bar)
    out: dict[str, Finding] = {}
    for u in a.unit_names:
        applies = bool(built) and not (ex.kind == "answer" and not base.reads[u])
        if ex.skips_work and base.reads[u] and not (u == "total" and shaping_in_mix):
            applies = False
        out[u] = _finding(
            ex,
            applies,
            per_row,
            vals[u],
            errs[u],
            texts,
            base.correct[u],
            base.wrong[u],
            bar[u],
            fail_share,
        )
    return out


def _score_exploit(
    a: _Audit, ex: Exploit, built: dict[int, list], base: _Baselines, bar: dict[str, list]
) -> tuple[list, dict[int, list[int]], dict[str, list], dict[str, dict[int, str]]]:
    """Score the completions ``built`` (row -> the exploit's variants for it): all in one
    batch, or for a set of guesses one variant at a time, each on the rows where every variant
    so far won for some unit (against ``bar``, the floor it must beat). The completions, each
    row's indices into them, and per unit their scores and errors."""
    texts: list = []
    per_row: dict[int, list[int]] = {}
    vals: dict[str, list] = {u: [] for u in a.unit_names}
    errs: dict[str, dict[int, str]] = {u: {} for u in a.unit_names}
    alive = list(built)
    for k in range(max((len(v) for v in built.values()), default=0) if ex.guesses else 1):
        if ex.guesses:
            todo = [(i, built[i][k]) for i in alive if k < len(built[i])]
        else:
            todo = [(i, t) for i in built for t in built[i]]
        if not todo:
            break
        offset = len(texts)
        scored = a.score([i for i, _ in todo], [t for _, t in todo])
        stage = a.unit_values(scored)
        for j, (i, t) in enumerate(todo):
            per_row.setdefault(i, []).append(offset + j)
            texts.append(t)
        for u in a.unit_names:
            vals[u].extend(stage[u])
            from_fns = [u] if u != "total" else a.names
            for n in from_fns:
                errs[u].update({offset + j: m for j, m in scored.errors[n].items()})
        alive = [
            i
            for j, (i, _) in enumerate(todo)
            if any(
                stage[u][j] is not None
                and offset + j not in errs[u]
                and _won(stage[u][j], base.correct[u][i], bar[u][i], base.wrong[u][i], ex.must_beat)
                for u in a.unit_names
            )
        ]
    return texts, per_row, vals, errs


def _probe_findings(a: _Audit, name: str, probe: Callable) -> dict[str, Finding]:
    """How each unit took the out-of-contract input ``probe`` (nothing when no row takes it)."""
    wanted = [
        c
        for c in a.ctxs
        if name in ("none_completion", "non_string_completion") or _correct_texts(c)
    ]
    if not wanted:
        return {}
    ps = a.score([c.index for c in wanted], [probe(c) for c in wanted])
    pv = a.unit_values(ps)
    out: dict[str, Finding] = {}
    for u in a.unit_names:
        errs = ps.errors.get(u, {}) if u != "total" else {}
        out[u] = _probe_finding(name, pv[u], len(wanted), errs)
    return out


def _unit_report(a: _Audit, u: str, base: _Baselines, fs: list[Finding]) -> UnitReport:
    """The verdict on unit ``u`` from its findings ``fs`` and its baselines."""
    cs = [v for v in base.correct[u] if v is not None]
    ws = [v for v in base.wrong[u] if v is not None]
    verdict = (
        "fragile"
        if any(f.status == "ERROR" for f in fs)
        else ("exploitable" if any(f.status == "EXPLOIT" for f in fs) else "clean")
    )
    note = (
        ""
        if base.reads[u]
        else "does not tell a right answer from a wrong one (format or shaping reward): answer-shaped exploits do not apply"
    )
    if not cs:
        note = "no correct completion could be written for these rows"
    scored_any = any(v is not None for v in base.floor[u])  # the nonsense completion too
    if not cs and not ws and scored_any and not a.answers_known:
        # rows with no reference answer: no right or wrong completion exists to score, only
        # the format and robustness probes (the report's note says so); what it gave them is
        # its verdict
        note = "no right or wrong completion could be written for these rows (no reference answer)"
    elif not cs and not ws and a.ctxs:
        # it scored nothing at all: not "clean", and not an exploit that "earns credit"
        raised = next((f for f in fs if f.exploit == "correct_completion"), None)
        if raised is not None and raised.errors:
            note = (
                f"it raised on every completion ({raised.error}): it scores nothing; fix "
                "it before training"
            )
        else:
            note = (
                "it returned None for every completion (None = 'does not apply'): it "
                "scores nothing; check that it reads the columns these rows have"
            )
        verdict = "broken"
    judged = u == "total" or len(a.specs) == 1 or base.reads[u]
    return UnitReport(
        name=u,
        weight=1.0 if u == "total" else a.weights[u],
        reads_answers=base.reads[u],
        judged=judged,
        correct_mean=sum(cs) / len(cs) if cs else None,
        wrong_mean=sum(ws) / len(ws) if ws else None,
        findings=fs,
        verdict=verdict,
        note=note,
    )


def _max_known(*values):
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _won(e: float, cv, fl, wv, must_beat: bool) -> bool:
    """Whether exploit score ``e`` wins a row with correct ``cv``, floor ``fl``, wrong ``wv``."""
    if cv is None:  # no correct completion known: beating the wrong one is the win
        return wv is not None and e > wv + _EPS
    matched = e > cv + _EPS if must_beat else e >= cv - _EPS
    return matched and (fl is None or e > fl + _EPS)


def _finding(ex, applies, per_row, vals, errs, texts, correct, wrong, floor, fail_share) -> Finding:
    """How one exploit did against one unit, row by row (see the module docstring)."""
    scores, wins, errors, first_err, example = [], 0, 0, None, None
    for i, ks in per_row.items():
        bad = [errs[k] for k in ks if k in errs]
        if bad:
            errors += 1
            first_err = first_err or _short_error(bad[0])
            continue
        got = [vals[k] for k in ks]
        if any(g is None for g in got):
            continue  # not applicable to this row (the function returned None)
        e = min(got) if ex.guesses else max(got)
        scores.append(e)
        if example is None:
            example = texts[ks[0]]
        won = _won(e, correct[i], floor[i], wrong[i], ex.must_beat)
        if won:
            if wins == 0:
                example = texts[ks[max(range(len(got)), key=got.__getitem__)]]
            wins += 1
    n = len(scores)
    if not applies and not errors:
        status = "n/a"
    elif ex.kind == "equivalent":
        status = "info"
    elif errors:
        status = "ERROR"
    elif n and wins / n >= fail_share - 1e-12:
        status = "EXPLOIT"
    else:
        status = "ok"
    mean = sum(scores) / n if n else None
    return Finding(ex.name, ex.kind, status, mean, wins, n + errors, errors, first_err, example)


def _probe_finding(name: str, values: list, n: int, errors: dict[int, str]) -> Finding:
    """An out-of-contract input: raising is fine (the trainer never passes it), NaN is not."""
    scored = [v for v in values if v is not None]
    msgs = list(errors.values())
    bad = [m for m in msgs if "non-finite" in m or "not a number" in m or "float32" in m]
    return Finding(
        name,
        "robustness",
        "ERROR" if bad else "info",
        sum(scored) / len(scored) if scored else None,
        0,
        n,
        len(errors),
        _short_error((bad or msgs)[0]) if msgs else None,
    )


_BATCH_ERR_RE = re.compile(
    r"raised on the batch of \d+(?: \(first failing sample index \d+: .*\))?: (.*)$", re.S
)
_SAMPLE_ERR_RE = re.compile(r"sample \d+: (.*)$", re.S)
#: ``score_rewards``' message for a call that returned no list of one score per completion
_SHAPE_ERR_RE = re.compile(
    r"reward '[^']*' returned (?:\d+ scores for \d+ completions|a \w+, expected a list of "
    r"\d+ floats or None)"
)


def _short_error(msg: str) -> str:
    """The exception (or the bad value) out of a ``score_rewards`` error message."""
    m = _BATCH_ERR_RE.search(msg) or _SAMPLE_ERR_RE.search(msg)
    return (m.group(1) if m else msg)[:160]


# ----------------------------------------------------------------------------- entry points


def first_rows(task, n: int, seed: int = 0) -> list[dict]:
    """The first ``n`` training rows of ``task`` (the rows the run will see first)."""
    if n < 1:
        raise ValueError(f"audit: rows must be >= 1, got {n}")
    return list(itertools.islice(task.train_rows(seed), n))


def at_startup(cfg, task, specs: Sequence[RewardSpec], *, show: bool = True) -> AuditReport | None:
    """``train.audit_rewards``: the battery on a few rows before the model loads.

    ``warn``: one line per exploitable or fragile function on stderr (nothing when clean);
    ``fail``: the same, then ``AuditError``; ``off``: nothing. A function that returned no
    list of one score per completion is an ``AuditError`` under ``warn`` too (one line naming
    it, what it returned and for how many completions): nothing it returns can be scored. The global random generators
    are left as they were (a reward function that draws from them would shift the run)."""
    mode = cfg.train.audit_rewards
    if mode == "off":
        _audit_judges(cfg, task, specs, mode, show)  # one line per judge: not audited
        return None
    if mode not in ("warn", "fail"):
        raise ValueError(f"train.audit_rewards={mode!r}; expected 'warn', 'fail' or 'off'")
    import torch

    py_state, torch_state = random.getstate(), torch.random.get_rng_state()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    judged = specs
    # reward models are left out: each exploit would cost a forward pass (and the memory of
    # a long filler completion); ``peergrade audit`` takes them when asked. A judge gets its
    # own probes instead (``_audit_judges``)
    specs = [s for s in specs if not getattr(s.fn, "skip_startup_audit", False)]
    try:
        _audit_judges(cfg, task, judged, mode, show)
        if not specs:
            return None
        rows = first_rows(task, STARTUP_ROWS, cfg.train.seed)
        if any(_code_info(r) for r in rows[:1]):
            rows = rows[:STARTUP_CODE_ROWS]  # each program is a sandboxed process
        from peergrade.rewards.judge import exploit_battery

        with exploit_battery(len(rows), show=show):  # a judge a function calls: one line
            report = audit_rewards(specs, rows, max_steps=cfg.train.steps)
    finally:
        random.setstate(py_state)
        torch.random.set_rng_state(torch_state)
        if np_state is not None:
            np.random.set_state(np_state)
    shape = report.shape_errors()
    if shape:  # no score can be read from it at all: the run stops here, before the model loads
        raise AuditError(
            "; ".join(shape) + " (called on a batch of the first rows by the start-up audit, "
            "train.audit_rewards): a reward function returns one score per completion, in "
            "order (None where it does not apply); fix it before training"
        )
    lines = report.lines()
    if show:
        for line in lines:
            print(line, file=sys.stderr)
    if mode == "fail" and report.failed:
        raise AuditError(
            "; ".join(lines) + ". See the tables with `peergrade audit --config ...`, or set "
            "train.audit_rewards: warn"
        )
    return report


def _audit_judges(cfg, task, specs: Sequence[RewardSpec], mode: str, show: bool) -> None:
    """The judge rewards among ``specs`` audited with their own probes, within
    ``train.audit_judge_requests`` (``judge_audit.startup_audit``): one line per judge with its
    verdict (and one per finding), or why it was not audited; ``fail`` and a finding:
    ``AuditError``. A judge endpoint that refuses its requests (HTTP 4xx) stops the run here."""
    from peergrade.rewards.judge_audit import judge_of, startup_audit

    if not any(judge_of(s) is not None for s in specs):
        return
    off = "train.audit_rewards: off" if mode == "off" else None
    rows = [] if off else first_rows(task, STARTUP_JUDGE_ROWS, cfg.train.seed)
    lines, reports = startup_audit(
        specs, rows, budget=cfg.train.audit_judge_requests, answers=cfg.rollout.group_size, off=off
    )
    if show:
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    failed = [f"{r.name}: {f}" for r in reports for f in r.findings]
    if mode == "fail" and failed:
        raise AuditError(
            "judge audit: " + "; ".join(failed) + ". See the table with `peergrade audit "
            "--config ...`, or set train.audit_rewards: warn"
        )
