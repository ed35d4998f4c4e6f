"""The agreement check's results as a table (one row per prompt and dtype, its disagreements
below it, a total per dtype) or as one JSON object."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cloudd.llamacpp_agreement.agreement import NEAR_TIE_NATS, Disagreement, PromptAgreement, TopTwo

# A token id -> its text, for people (the tokenizer's decode of that one token).
Namer = Callable[[int], str]


def summary(results: Sequence[PromptAgreement], near_tie: float = NEAR_TIE_NATS) -> dict[str, dict[str, Any]]:
    """Per dtype: prompts, greedy continuations identical, mean share matched before the first
    difference, teacher-forced top-1 agreement over all positions, disagreements, and how many
    of them (and of the greedy divergences) are near-ties, and the widest one's margin."""
    out = {}
    for dtype in dict.fromkeys(r.dtype for r in results):
        rows = [r for r in results if r.dtype == dtype]
        positions = sum(r.tokens for r in rows)
        disagreements = [d for r in rows for d in r.disagreements]
        divergences = [r.divergence for r in rows if r.divergence is not None]
        out[dtype] = {
            "prompts": len(rows),
            "greedy_identical": sum(r.divergence is None for r in rows),
            "greedy_match_mean": sum(r.greedy_match / r.tokens for r in rows) / len(rows),
            "top1_agree": sum(r.top1_agree for r in rows),
            "positions": positions,
            "top1_rate": sum(r.top1_agree for r in rows) / positions,
            "disagreements": len(disagreements),
            "disagreements_near_tie": sum(d.near_tie(near_tie) for d in disagreements),
            "divergences_near_tie": sum(d.near_tie(near_tie) for d in divergences),
            # the widest of them: min(our margin, theirs), the largest over both kinds (0 when none)
            "widest_margin": max((min(d.ours.margin, d.theirs.margin) for d in disagreements + divergences),
                                 default=0.0),
        }
    return out


def format_table(results: Sequence[PromptAgreement], name: Namer, near_tie: float = NEAR_TIE_NATS) -> str:
    lines = [f"{'prompt':<22}{'dtype':<10}{'greedy match':>14}{'top-1 (forced)':>18}"]
    for r in results:
        lines.append(f"{r.prompt:<22}{r.dtype:<10}{f'{r.greedy_match}/{r.tokens}':>14}"
                     f"{f'{r.top1_agree}/{r.tokens} {r.top1_rate:.1%}':>18}")
        if r.divergence is not None:
            lines.append(f"    greedy diverges: {_describe(r.divergence, name, near_tie)}")
        lines += [f"    forced: {_describe(d, name, near_tie)}" for d in r.disagreements]
    for dtype, s in summary(results, near_tie).items():
        lines.append(
            f"{dtype}: greedy identical {s['greedy_identical']}/{s['prompts']} (mean match "
            f"{s['greedy_match_mean']:.1%}); teacher-forced top-1 {s['top1_rate']:.2%} ({s['top1_agree']}/"
            f"{s['positions']}); {s['disagreements']} disagreements, {s['disagreements_near_tie']} near-ties; "
            f"greedy divergences near-ties {s['divergences_near_tie']}/{s['prompts'] - s['greedy_identical']}")
    return "\n".join(lines)


def _describe(d: Disagreement, name: Namer, near_tie: float) -> str:
    """``at 17: ours 'x' > 'y' by 0.120 (0.120 above theirs) | llama.cpp 'y' > 'x' by 0.050: near-tie``:
    each side's top-2 and margin in nats, and how far our top-1 is above theirs in our log-probs."""
    verdict = "near-tie" if d.near_tie(near_tie) else "WIDE"
    return (f"at {d.position}: ours {_top(d.ours, name)} ({d.ours_gap:.3f} above theirs) | "
            f"llama.cpp {_top(d.theirs, name)}: {verdict}")


def _top(t: TopTwo, name: Namer) -> str:
    return f"{name(t.ids[0])!r} > {name(t.ids[1])!r} by {t.margin:.3f}"


def as_json(model: str, results: Sequence[PromptAgreement], name: Namer, near_tie: float = NEAR_TIE_NATS) -> dict:
    return {
        "model": model,
        "near_tie_nats": near_tie,
        "summary": summary(results, near_tie),
        "prompts": [{
            "prompt": r.prompt, "dtype": r.dtype, "tokens": r.tokens, "greedy_match": r.greedy_match,
            "top1_agree": r.top1_agree, "top1_rate": r.top1_rate,
            "divergence": None if r.divergence is None else _disagreement_json(r.divergence, name, near_tie),
            "disagreements": [_disagreement_json(d, name, near_tie) for d in r.disagreements],
        } for r in results],
    }


def _disagreement_json(d: Disagreement, name: Namer, near_tie: float) -> dict:
    return {"position": d.position, "ours": _top_json(d.ours, name), "theirs": _top_json(d.theirs, name),
            "ours_gap": d.ours_gap, "near_tie": d.near_tie(near_tie)}


def _top_json(t: TopTwo, name: Namer) -> dict:
    return {"ids": list(t.ids), "texts": [name(i) for i in t.ids], "logprobs": list(t.logprobs), "margin": t.margin}
