"""Choose a decode setting for a model and a workload: the cheapest that stays within a stated drop of full
attention (``rolecall tune``).

Every candidate (full attention, and each policy the manifest allows at each budget, delta also at each
``refine``) decodes the same prompts greedily on the engine. Its score is compared with full attention's over
the very same prompts: the mean paired difference and its 95 % interval
(:func:`rolecall.eval.stats.paired_difference`), in points, hundredths of the score. Each candidate is then
timed on the engine at the user's batch and context: TPOT is ``Generation.decode_s / steps`` of a second
request (the first compiles and captures).

The choice is the cheapest candidate whose interval's lower end lies above ``-max_drop`` points, cheapest by
TPOT (``cost="tpot"``) or by the share of the context it reads (``cost="keys"``, the same on any machine);
ties go to the higher score. Full attention always qualifies, so when no sparse setting does it is the choice,
and :func:`choose` also names the sparse setting that came closest.

A run keeps its work in a folder: each candidate's finished batches (``cells/<name>.jsonl``,
:class:`rolecall.eval.runner.Checkpoint`), then its scores and timing in ``tune.json``, written atomically as
each candidate finishes. A run stopped midway resumes where it stopped; a finished one chooses again without
decoding (another ``max_drop`` or ``cost`` is a new choice over the same evidence). A folder of another run
(other model, manifest, prompts, batch or context) is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rolecall.core import atomic
from rolecall.eval.budgets import policy_params
from rolecall.eval.runner import device_label
from rolecall.eval.stats import paired_difference

COSTS = ("tpot", "keys")
NEEDS = {"delta": "layers", "lychee": "heads", "lethe": "layers", "quest": None}  # policy -> manifest section
DEFAULT_POLICIES = ("delta", "lychee", "quest")
RECORD = "tune.json"


@dataclass(frozen=True)
class Candidate:
    """One setting to try: a policy at a token budget (see :mod:`rolecall.eval.budgets`), delta with ``refine``."""

    policy: str
    budget: int | None = None
    refine: int = 1

    @property
    def params(self) -> dict[str, Any]:
        params = policy_params(self.policy, self.budget) if self.budget is not None else {}
        return {**params, "refine": self.refine} if self.refine > 1 else params

    @property
    def name(self) -> str:
        if self.budget is None:
            return self.policy
        return f"{self.policy} budget={self.budget}" + (f" refine={self.refine}" if self.refine > 1 else "")

    @property
    def slug(self) -> str:
        """The name as a file name."""
        return self.name.replace(" ", "_").replace("=", "")


@dataclass(frozen=True)
class TuneSettings:
    """What the choice needs beside the prompts: ``max_drop`` (points, > 0), the ``batch`` and ``context`` the
    candidates are timed at (context: prompt tokens; None = the longest prompt), ``time_tokens`` generated per
    timed request, ``cost`` (``"tpot"`` or ``"keys"``) and ``eval_batch`` (prompts decoded together while
    scoring; None = the evaluation's default)."""

    max_drop: float = 1.0
    batch: int = 1
    context: int | None = None
    time_tokens: int = 16
    cost: str = "tpot"
    eval_batch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_drop, (int, float)) or not math.isfinite(self.max_drop) or self.max_drop <= 0:
            raise ValueError(f"max_drop {self.max_drop!r}: give the largest drop from full attention you accept, in "
                             "points above 0 (1.0 = one hundredth of the score)")
        for key, least in (("batch", 1), ("time_tokens", 2), ("context", 1), ("eval_batch", 1)):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{key} {value!r}: give a whole number of at least {least}")
        if self.cost not in COSTS:
            raise ValueError(f"cost {self.cost!r}: give one of {', '.join(COSTS)}")


def candidates(sections: list[str], policies: tuple[str, ...] | None, budgets: tuple[int, ...],
               refines: tuple[int, ...] = (1,)) -> list[Candidate]:
    """Full attention, then each of ``policies`` at each budget (delta also at each ``refine``). ``policies``
    None: those of :data:`DEFAULT_POLICIES` the manifest's ``sections`` allow. A named policy whose section the
    manifest lacks, or one ``rolecall tune`` does not try, is refused in one line."""
    if not budgets or min(budgets) < 1:
        raise ValueError(f"budgets {list(budgets)}: give at least one token budget of at least 1")
    if not refines or min(refines) < 1:
        raise ValueError(f"refine {list(refines)}: give whole numbers of at least 1 (1 = off)")
    if policies is None:
        policies = tuple(p for p in DEFAULT_POLICIES if NEEDS[p] is None or NEEDS[p] in sections)
    for p in policies:
        if p not in NEEDS:
            raise ValueError(f"policy {p!r}: rolecall tune tries {', '.join(NEEDS)} (full attention always)")
        if NEEDS[p] is not None and NEEDS[p] not in sections:
            raise ValueError(f"policy {p} needs a manifest with a {NEEDS[p]} section, and this one holds "
                             f"{', '.join(sections) or 'none'}; leave {p} out or pass a manifest that has it")
    out = [Candidate("full")]
    for policy in policies:
        for budget in sorted(set(budgets)):
            out += [Candidate(policy, budget, r) for r in (sorted(set(refines)) if policy == "delta" else (1,))]
    return out


def prompts_sha256(samples: list[dict[str, Any]]) -> str:
    """One hash over the prompts' token ids and answers: what ties a run folder to its prompts."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([torch.as_tensor(s["input_ids"]).flatten().tolist(), s.get("answer"),
                             s.get("answers"), s.get("max_new_tokens")], default=str).encode())
    return h.hexdigest()


class Record:
    """``tune.json`` of a run folder: the run's identity (``header``) and each finished candidate's evidence."""

    def __init__(self, folder: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(folder) / RECORD
        self.header = json.loads(json.dumps(header))
        self.done: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            stored = json.loads(self.path.read_text())
            theirs = stored.get("header", {})
            if theirs != self.header:
                key = next(k for k in sorted({*theirs, *self.header}) if theirs.get(k) != self.header.get(k))
                raise ValueError(f"{self.path.parent} holds another tune run (its {key} is {theirs.get(key)!r}, this "
                                 f"run's {self.header.get(key)!r}); pass another --out folder or delete that one")
            self.done = stored.get("candidates", {})

    def put(self, name: str, evidence: dict[str, Any]) -> None:
        self.done[name] = {**self.done.get(name, {}), **evidence}
        atomic.write_text(self.path, json.dumps({"header": self.header, "candidates": self.done}, indent=1,
                                                sort_keys=True) + "\n")


def check_answers(samples: list[dict[str, Any]]) -> None:
    """Every prompt has an ``answer`` or ``answers`` to score against; the first that has none is refused in one
    line (``ValueError``) before any decoding."""
    missing = next((i for i, s in enumerate(samples) if not (s.get("answer") or s.get("answers"))), None)
    if missing is not None:
        raise ValueError(f"prompt {missing + 1} has no answer to score: rolecall tune compares scores, so every "
                         "prompt needs an 'answer' or 'answers'")


def score(model, tokenizer, manifest, todo: list[Candidate], record: Record, samples: list[dict[str, Any]],
          settings: Any, eval_batch: int | None, folder: Path) -> None:
    """Decode ``samples`` with every candidate of ``todo`` on the engine (one prefill a batch, shared) and put
    each one's per-prompt scores, mean score and share of the context read into ``record``."""
    from rolecall.eval.runner import Job, evaluate_many

    (folder / "cells").mkdir(parents=True, exist_ok=True)
    jobs = [Job(c.policy, manifest, {**c.params, "engine": "static"}, folder / "cells" / f"{c.slug}.jsonl")
            for c in todo]
    results = evaluate_many(model, tokenizer, jobs, settings, samples, measure=False, batch_size=eval_batch)
    for c, result in zip(todo, results):
        scores = [s["score"] for s in result["samples"]]
        record.put(c.name, {"policy": c.policy, "params": c.params, "scores": scores,
                            "score": sum(scores) / len(scores), "attended_fraction": result["attended_fraction"]})


def time_candidate(model, manifest, candidate: Candidate, batch: int, context: int, new_tokens: int) -> float:
    """TPOT in ms of ``candidate`` on the engine: ``batch`` prompts of ``context`` random tokens (fixed seed),
    ``new_tokens`` generated greedily; the second of two requests (the first compiles and captures)."""
    from rolecall.core.tokens import vocab_size
    from rolecall.runtime.session import attach

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size(model.config), (batch, context), generator=gen).to(model.device)
    with attach(model, manifest, candidate.policy, engine="static", min_context=0, **candidate.params) as session:
        for _ in range(2):
            session.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        last = session.last
    return 1e3 * last.decode_s / max(last.steps, 1)


def evidence_rows(found: list[Candidate], record: Record) -> list[dict[str, Any]]:
    """Each candidate's evidence with its paired difference to full attention, in points."""
    full = record.done["full"]["scores"]
    rows = []
    for c in found:
        e = record.done[c.name]
        d = paired_difference([100 * x for x in e["scores"]], [100 * x for x in full])
        rows.append({"name": c.name, "policy": c.policy, "params": e["params"], "score": e["score"],
                     "difference": d["mean"], "interval": d["interval"], "n": d["n"],
                     "attended_fraction": 1.0 if c.policy == "full" else e["attended_fraction"],
                     "tpot_ms": e.get("tpot_ms")})
    return rows


def cost_of(row: dict[str, Any], cost: str) -> float:
    value = row["tpot_ms"] if cost == "tpot" else row["attended_fraction"]
    return math.inf if value is None else value


def qualifies(row: dict[str, Any], max_drop: float) -> bool:
    return row["policy"] == "full" or row["interval"][0] > -max_drop


def choose(rows: list[dict[str, Any]], max_drop: float, cost: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The cheapest row that qualifies (its interval's lower end above ``-max_drop``; full attention always
    does), ties to full attention, then the higher score, then the name; and when that is full attention, the sparse row with the
    highest lower end (the one that came closest), else None."""
    ok = [r for r in rows if qualifies(r, max_drop)]
    chosen = min(ok, key=lambda r: (cost_of(r, cost), r["policy"] != "full", -r["difference"], r["name"]))
    sparse = [r for r in rows if r["policy"] != "full"]
    closest = max(sparse, key=lambda r: (r["interval"][0], r["name"])) if chosen["policy"] == "full" and sparse else None
    return chosen, closest


def tune(model, tokenizer, manifest, found: list[Candidate], samples: list[dict[str, Any]], settings: Any,
         tuning: TuneSettings, folder: str | Path, header: dict[str, Any], progress=print) -> dict[str, Any]:
    """Score and time every candidate of ``found`` (resuming ``folder``'s record; ``header`` names the run) and
    choose among them (see the module docstring). Returns ``{"rows", "chosen", "closest", "context", ...}``."""
    check_answers(samples)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    context = tuning.context or max(int(torch.as_tensor(s["input_ids"]).numel()) for s in samples)
    record = Record(folder, {**header, "batch": tuning.batch, "context": context, "time_tokens": tuning.time_tokens,
                             "prompts_sha256": prompts_sha256(samples), "prompts": len(samples)})
    todo = [c for c in found if "scores" not in record.done.get(c.name, {})]
    if todo:
        progress(f"scoring {len(todo)} of {len(found)} settings on {len(samples)} prompts")
        score(model, tokenizer, manifest, todo, record, samples, settings, tuning.eval_batch, folder)
    for c in found:
        if "tpot_ms" not in record.done[c.name]:
            progress(f"timing {c.name} at batch {tuning.batch}, {context:,} tokens")
            ms = time_candidate(model, manifest, c, tuning.batch, context, tuning.time_tokens)
            record.put(c.name, {"tpot_ms": ms, "device": device_label(model)})
    rows = evidence_rows(found, record)
    chosen, closest = choose(rows, tuning.max_drop, tuning.cost)
    return {"rows": rows, "chosen": chosen, "closest": closest, "context": context, "batch": tuning.batch,
            "max_drop": tuning.max_drop, "cost": tuning.cost, "device": record.done["full"].get("device")}


def recommendation(result: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The manifest's ``recommended`` entry for a :func:`tune` result: the chosen policy and parameters and their
    evidence (score, difference to full and its interval in points, prompts, share read, TPOT, GPU), with what
    the run was (``run``: suite, lengths, seed, command)."""
    c = result["chosen"]
    full = next(r for r in result["rows"] if r["policy"] == "full")
    evidence = {"score": c["score"], "full_score": full["score"], "difference": c["difference"],
                "interval": c["interval"], "n": c["n"], "attended_fraction": c["attended_fraction"],
                "tpot_ms": c["tpot_ms"], "full_tpot_ms": full["tpot_ms"], "device": result["device"],
                "batch": result["batch"], "context": result["context"], "max_drop": result["max_drop"],
                "cost": result["cost"], **run}
    if result["closest"] is not None:
        evidence["closest"] = {k: result["closest"][k] for k in ("name", "difference", "interval")}
    return {"policy": c["policy"], "params": c["params"], "evidence": evidence}


def format_table(result: dict[str, Any]) -> str:
    """The candidates as a Markdown table, the chosen one marked, and a line saying what was chosen."""
    lines = ["| setting | score | − full (points, 95 %) | read | TPOT ms | within |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        low, high = r["interval"]
        mark = " ←" if r["name"] == result["chosen"]["name"] else ""
        tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "–"
        lines.append(f"| {r['name']}{mark} | {r['score']:.3f} | {r['difference']:+.1f} [{low:+.1f}, {high:+.1f}] | "
                     f"{r['attended_fraction']:.3f} | {tpot} | {'yes' if qualifies(r, result['max_drop']) else 'no'} |")
    c, closest = result["chosen"], result["closest"]
    lines.append("")
    if closest is not None:
        low = closest["interval"][0]
        lines.append(f"no sparse setting stays within {result['max_drop']:g} points of full attention (the closest, "
                     f"{closest['name']}, may lose {-low:.1f}); recommended: full attention")
    else:
        lines.append(f"recommended: {c['name']} (cheapest by {result['cost']} within {result['max_drop']:g} points)")
    return "\n".join(lines)


def plot_frontier(result: dict[str, Any], path: str | Path) -> Path:
    """Score difference to full attention (with its interval) against cost, one point a candidate, the
    accepted drop as a line and the chosen candidate marked; a PNG written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = result["cost"]
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    policies = sorted({r["policy"] for r in result["rows"]})
    xs = [cost_of(r, cost) for r in result["rows"] if math.isfinite(cost_of(r, cost))]
    dodge = 0.012 * (max(xs) - min(xs) if xs and max(xs) > min(xs) else 1.0)  # policies at one cost side by side
    for k, policy in enumerate(policies):
        rows = [r for r in result["rows"] if r["policy"] == policy]
        x = [cost_of(r, cost) + (k - (len(policies) - 1) / 2) * dodge for r in rows]
        y = [r["difference"] for r in rows]
        err = [[r["difference"] - r["interval"][0] for r in rows], [r["interval"][1] - r["difference"] for r in rows]]
        ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, label=policy)
    c = result["chosen"]
    ax.plot([cost_of(c, cost)], [c["difference"]], marker="*", markersize=16, color="black", linestyle="none",
            label=f"chosen: {c['name']}")
    ax.axhline(-result["max_drop"], color="gray", linestyle="--", linewidth=1, label=f"−{result['max_drop']:g} points")
    ax.set_xlabel(f"TPOT (ms) at batch {result['batch']}, {result['context']:,} tokens" if cost == "tpot"
                  else "share of the context read")
    ax.set_ylabel("score − full attention (points)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = atomic.write_figure(fig, path)
    plt.close(fig)
    return out
