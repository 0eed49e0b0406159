"""Promotion with a gate (``cascade promote``): a retrained bundle replaces the serving one only
where a paired comparison on the same held-out evidence says it keeps more, and it is swapped in
with a certificate that the choice did not break.

The evidence is the candidate's (``lineage.json``, written by ``distill.loop.retrain``), less any
item the serving bundle trained on, so that neither bundle is judged on an item it learnt from: the
items that certified it, and the uniform draws of its evaluation part. Neither bundle trained on
either part, so both bundles are certified afresh on all of them, as ``cascade calibrate`` does
(same target and certificate), each at half the delta this attempt may spend
(``distill.loop.gate``: Bonferroni over the two, and the k-th attempt since the last promotion,
counted from the promotions log, spends delta x 6 / (pi^2 k^2)); so with probability 1 - delta
both certificates hold, whichever bundle the rule then picks, and the rule may look at the same
items. Twice the items under the default split serve 3-4 points more of the population than
the certifying part alone did at 1,000 items of each, 11-19 at 300 (docs/benchmarks/retraining.md,
"Certifying on both held-out parts"). The rule (``gate.compare``) passes the candidate only where
the paired bootstrap lower bound on how much more it keeps (plug-in shares, averaged over the
questions and over a band of targets from the user's up to the one the certificate effectively
asks of these items: ``gate.band``) is above 0; a tie never passes.
Refused, it stays where it is with the reason in ``promotion.json``; the serving bundle then serves
the thresholds the gate certified for it instead (``refreshed``: a copy of it beside the candidate,
``CANDIDATE.serving``, swapped in as a promotion is) where its own keep nothing (a young cascade that
certified nothing yet: nothing there could fail), or where its own were certified by a gate and keep
fewer of these items (``refresh``: ``kept-nothing`` or ``keeps-more``). The second is valid by a
union bound, not by the choice: every certificate a bundle serves from its promotion to the next is
its promotion's (at most 0.30 delta, ``gate.attempt_delta(delta, 1) / 2``) or one a gate against it
certified (at most delta/2 over all attempts), so all of them hold together with probability at least
1 - 0.81 delta, whichever one is served. A bundle certified by ``cascade calibrate`` spent all of delta
on its own certificate, so that is never replaced while it keeps anything. Passed, its calibration is
replaced by the one the gate certified (the manifest's ``delta`` is then that level, and its
``asked_delta`` the delta asked for, which the next retrain asks for again) and it is
swapped in as ``cascade serve --bundle PATH`` follows one (``cascade.serve.swap``): where PATH is a
link or a pointer file, PATH is replaced in one rename to name the candidate's folder (each version
stays in its own folder); where PATH is the bundle folder itself, the candidate is copied over it
(the replaced bundle kept beside it as ``NAME.previous``). Either way one line goes to the
promotions log beside PATH (``NAME.promotions.jsonl``): both bundles' versions, when, the rule and
its figures. The record, the log and the swap are ``distill.loop.promotions``'s: the line is
written ahead of the swap, and one promotion of PATH runs at a time.

A drift alarm outranks the held-out evidence. Where the store's audits show an alarm risen on the
serving bundle's calibration (as the server's watch raises it), live traffic has refuted that
certificate, and the items labelled before the alarm are mostly of the traffic before the drift,
where it held: a certificate resting on them would lift the demotion on stale evidence (a
promotion or a refresh is a new calibration version, and the watch starts afresh on it). So the
gate then weighs and certifies both bundles only on the held-out items labelled after the alarm
(``gate.evidence_after``, ``gate.set_aside``), refuses where none are (the loop tries again after N
more labels), and the bundle it swaps in keeps that start in its manifest
(``calibration.evidence_after``), so the gates after it keep to it too.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from cascade.bundle.manifest import MANIFEST_NAME, Bundle
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError, CorpusError
from cascade.hashing import file_sha256
from cascade.serve.swap import resolve
from cascade.thresholds import CERTIFIED_SCORE
from distill.calibration.inputs import MissingItemsError
from distill.calibration.manifest import updated_manifest
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.loop.auditing import drift_alarms
from distill.loop.gate import RULE, Comparison, Question, band, certificate_delta, chain_ranks, compare
from distill.loop.promotions import (
    BundleVersion,
    Gate,
    Promotion,
    Refresh,
    carry_out,
    promoting,
    promotions_log,
    records,
    replaced_at,
    writable_log,
)
from distill.loop.retrain import EVIDENCE_NAME, LINEAGE_NAME
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore

KEPT_ASIDE_NAME = "promotion.json"


class PromoteError(CascadeError, ValueError):
    """Two bundles cannot be compared: another teacher, other questions, no held-out evidence."""


def promote(serving_path: Path, candidate_dir: Path, store: LabelStore, *, run: RunOptions | None = None,
            encoder: Encoder | None = None, log: Path | None = None) -> Promotion:
    """Weigh the candidate against the bundle ``serving_path`` names (a folder, a link to one, or a
    pointer file: ``cascade.serve.swap``) on the candidate's held-out evidence, and swap it in,
    with the thresholds the gate certified, where the rule says it keeps more; record the
    decision either way. One promotion of a serving path at a time (``promotions.promoting``)."""
    path = Path(serving_path)
    if not path.parent.is_dir():
        raise PromoteError(f"no bundle at {path}: the folder {path.parent} does not exist; give the path "
                           "`cascade serve --bundle` serves")
    try:
        resolve(path)  # before the lock: a mistyped --bundle left a lock file beside it
    except CascadeError as exc:
        raise PromoteError(str(exc)) from None
    log = writable_log(log or promotions_log(path))
    with promoting(path):
        return _promote(path, Path(candidate_dir), store, run, encoder, log)


def _promote(serving_path: Path, candidate_dir: Path, store: LabelStore, run: RunOptions | None,
             encoder: Encoder | None, log: Path) -> Promotion:
    try:
        serving_dir = resolve(Path(serving_path))
    except CascadeError as exc:
        raise PromoteError(str(exc)) from None
    if serving_dir == Path(candidate_dir).resolve():
        raise PromoteError(f"the candidate {candidate_dir} is the bundle serving already")
    serving, candidate = Bundle.load(serving_dir), Bundle.load(candidate_dir)
    attempt = _attempt(log, serving)  # the log read first: one damaged is said before the gate's work
    held, evaluated, excluded = _evidence(serving, candidate)
    if _same_bundle(serving_dir, Path(candidate_dir)):
        raise PromoteError(f"the candidate {candidate_dir} is the bundle serving already (a copy of it)")
    after, alarmed, labelled = _evidence_after(serving, store)
    held, evaluated, set_aside = _since(after, alarmed, held, evaluated, labelled)
    target, delta = _level(candidate)
    level = certificate_delta(delta, attempt)
    section = candidate.manifest.calibration
    certificate = section.certificate or "split"
    states = CorpusInput(Path(candidate_dir) / EVIDENCE_NAME)
    weighed = sorted(held) + sorted(evaluated)
    accepted = bool(section.degenerate_accepted or serving.manifest.calibration.degenerate_accepted)
    options = CalibrationOptions(target=target, delta=level, family_wise=section.family_wise,
                                 certificate=certificate, held_out=weighed, teacher_items=0, save=False,
                                 accept_degenerate_teacher=accepted)
    try:
        results = {name: calibrate_bundle(bundle, states, store, options, run=run, encoder=encoder)
                   for name, bundle in {"serving": serving, "candidate": candidate}.items()}
    except CorpusError as exc:  # its advice (--on-error skip) is labelling's, which the gate does not take
        why = str(exc).partition(" (--on-error")[0]
        raise PromoteError(f"the candidate's {EVIDENCE_NAME} is damaged: {why}; retrain it") from None
    except MissingItemsError as exc:  # its advice (give the corpus) is calibrate's: the gate takes none
        raise PromoteError(f"the candidate's {EVIDENCE_NAME} is damaged: {exc.count} of the items it was "
                           f"certified on are not in it (for example {exc.example!r}); retrain it") from None
    scores = {name: result.item_scores for name, result in results.items()}
    comparison = _compare(results, scores, weighed, band(target, len(weighed), level))
    gate = _gate(results, comparison, delta, attempt, len(held), excluded, len(evaluated),
                 _served_before(serving, results["serving"]))
    gate = gate.model_copy(update={"evidence_after": _iso(after), "set_aside": set_aside})
    if comparison.promotes:  # served with the thresholds the gate certified, at its level
        manifest = updated_manifest(candidate.manifest, results["candidate"])
        manifest.calibration.asked_delta = delta  # what the next retrain asks for again
        manifest.calibration.evidence_after = gate.evidence_after
        Bundle(manifest, candidate.directory, candidate.heads).save()
        candidate = Bundle.load(candidate_dir)
    refresh = None if comparison.promotes else _refresh(serving, results["serving"], gate)
    refreshed = None if refresh is None else _refreshed(serving, results["serving"], gate,
                                                        Path(candidate_dir))
    swapped = comparison.promotes or refreshed is not None
    replaced = replaced_at(serving_path, serving_dir)
    record = Promotion(at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       promoted=comparison.promotes, serving=BundleVersion.of(serving),
                       candidate=BundleVersion.of(candidate), gate=gate,
                       reason=_reason(gate, comparison.promotes, refreshed, refresh),
                       refreshed=None if refreshed is None else str(refreshed), refresh=refresh,
                       previous=str(replaced) if swapped else None)
    if not record.promoted:
        (Path(candidate_dir) / KEPT_ASIDE_NAME).write_text(record.model_dump_json(indent=2) + "\n",
                                                           encoding="utf-8")
    carry_out(serving_path, log, record)
    return record


def _same_bundle(serving_dir: Path, candidate_dir: Path) -> bool:
    """Whether the candidate is a copy of the bundle serving (its manifest and evidence): a folder
    ``--bundle`` holds a copy of the candidate it promoted, so the same candidate again was
    weighed against itself, spending an attempt's delta on a tie."""
    for name in (MANIFEST_NAME, EVIDENCE_NAME):
        ours, theirs = serving_dir / name, candidate_dir / name
        if not (ours.is_file() and theirs.is_file()) or file_sha256(ours) != file_sha256(theirs):
            return False
    return True


def _refresh(serving: Bundle, result: CalibrationResult, gate: Gate) -> Refresh | None:
    """Whether the serving bundle, kept serving, takes the thresholds this gate certified for it
    (they must keep something): where its own keep nothing, or where a gate certified its own (a
    promotion's or an earlier refresh's, with ``asked_delta`` this gate's delta, at the same target)
    and they keep fewer of the items weighed. Never in place of a certificate that spent all of
    delta on its own (``cascade calibrate``'s): the union bound in the module's docstring needs the
    certificate replaced to be a gate's."""
    if not any(fit.threshold is not None and fit.tier not in result.dropped() for fit in result.calibrations):
        return None
    if all(t is None for row in serving.manifest.thresholds.values() for t in row.values()):
        return "kept-nothing"
    section = serving.manifest.calibration
    gate_made = section.asked_delta == gate.delta and section.target == gate.target
    before = gate.serving_before
    if gate_made and before is not None and gate.serving_share > before:
        return "keeps-more"
    return None


def _served_before(serving: Bundle, result: CalibrationResult) -> dict[str, float] | None:
    """Per question, the share the serving bundle's own thresholds keep of the items the gate
    scored it on (kept where any cheap tier's raw score clears its threshold, as the router keeps
    it); None where its thresholds are not on the score the gate's are (an older bundle)."""
    if serving.manifest.threshold_on != CERTIFIED_SCORE:
        return None
    shares = {}
    for qid, scored in result.item_scores.items():
        row = serving.manifest.thresholds.get(qid, {})
        ids = set().union(*scored.values())
        cuts = {tier: cut for tier, cut in row.items() if cut is not None}
        kept = {item for tier, scores in scored.items() if tier in cuts
                for item, (score, _) in scores.items() if score >= cuts[tier]}
        shares[qid] = len(kept) / len(ids) if ids else 0.0
    return shares


def _refreshed(serving: Bundle, result: CalibrationResult, gate: Gate, candidate_dir: Path) -> Path:
    """A copy of the serving bundle with the thresholds the gate certified for it
    (``CANDIDATE.serving``), to serve."""
    target = candidate_dir.with_name(f"{candidate_dir.name}.serving")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(serving.directory, target)
    manifest = updated_manifest(serving.manifest, result)
    manifest.calibration.asked_delta = gate.delta
    manifest.calibration.evidence_after = gate.evidence_after
    Bundle(manifest, target, serving.heads).save()
    return target


def _evidence_after(serving: Bundle, store: LabelStore) -> tuple[float | None, list[str], dict[str, float]]:
    """When the evidence a gate may weigh begins, the questions whose drift alarm set it, and when
    each item was labelled: the last alarm that rose on the serving bundle's calibration in the
    store's audits, or the start its own certificate already kept to (``evidence_after``); None
    (and no times read): every item."""
    alarms = drift_alarms(serving.manifest, store.each_audit())
    own = serving.manifest.calibration.evidence_after
    if not alarms and not own:
        return None, [], {}
    labelled = store.labelled_at()
    starts = [datetime.fromisoformat(own).timestamp()] if own else []
    starts += [labelled.get(record.item_id, record.at) for record in alarms.values()]
    return max(starts), sorted(alarms), labelled


def _since(after: float | None, alarmed: list[str], held: list[str], evaluated: list[str],
           labelled: dict[str, float]) -> tuple[list[str], list[str], int]:
    """The held-out items labelled after ``after`` (all where None), and how many were set aside."""
    if after is None:
        return held, evaluated, 0
    late = [[i for i in part if labelled.get(i, after) > after] for part in (held, evaluated)]
    if not late[0]:
        why = (f"the drift alarm of {', '.join(alarmed)} on the serving bundle's calibration refuted its "
               "certificate on live traffic" if alarmed else "the serving bundle's certificate rests on "
               "items labelled after an earlier drift alarm")
        raise PromoteError(f"{why}, so only items labelled after {_iso(after)} may weigh and certify, and "
                           f"none of the candidate's {len(held)} certifying items was: retrain again once "
                           "traffic since then is labelled (`cascade loop` does, after N more labels)")
    return late[0], late[1], len(held) + len(evaluated) - len(late[0]) - len(late[1])


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat()


def _attempt(log: Path, serving: Bundle) -> int:
    """Which attempt against this serving bundle this is, counted from the log: one more than the
    decisions since the last promotion (or since the log began), since every attempt reuses
    held-out items like the last ones, so each spends its own share of delta. A serving bundle the
    gate refreshed (``refreshed``) is the same one; one changed by hand keeps the count going."""
    logged = records(log)
    since = next((k for k in range(len(logged) - 1, -1, -1) if logged[k].promoted), -1)
    return len(logged) - since


def _evidence(serving: Bundle, candidate: Bundle) -> tuple[list[str], list[str], int]:
    """The candidate's held-out ids the serving bundle never trained on: those that certified it,
    and its evaluation part's (none in a lineage from before they were recorded); and how many
    of the certifying ones the serving bundle trained on."""
    lineage_path = candidate.directory / LINEAGE_NAME
    missing = [name for name in (LINEAGE_NAME, EVIDENCE_NAME) if not (candidate.directory / name).is_file()]
    if missing:
        raise PromoteError(f"{candidate.directory} has no {' and no '.join(missing)}: promote a bundle made "
                           "by `cascade retrain`, which holds the evidence it is weighed on")
    ours, theirs = serving.manifest, candidate.manifest
    if ours.teacher != theirs.teacher or ours.questions != theirs.questions:
        raise PromoteError(f"bundles {ours.name!r} and {theirs.name!r} differ in their teacher or their "
                           "questions: a promotion compares certificates about one teacher's answers to "
                           "the same questions; retrain from the serving bundle")
    lineage = _lineage_of(lineage_path)
    trained = set(serving.split_ids().get("train", []))
    certified_on = list(lineage.get("certified_on", []))
    held = [i for i in certified_on if i not in trained]
    if not held:
        raise PromoteError(f"every one of the {len(certified_on)} items that certified {theirs.name!r} "
                           f"trained {ours.name!r}: there is no held-out evidence to weigh them on")
    evaluated = [i for i in lineage.get("evaluated_on", []) if i not in trained]
    return held, evaluated, len(certified_on) - len(held)


def _lineage_of(path: Path) -> dict[str, Any]:
    """The candidate's lineage, refused in one line where it is not the object retrain wrote."""
    try:
        lineage = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        lineage = exc
    if not isinstance(lineage, dict) or not all(isinstance(lineage.get(key, []), list)
                                                for key in ("certified_on", "evaluated_on")):
        raise PromoteError(f"{path} is damaged (not the lineage `cascade retrain` writes); retrain the "
                           "candidate") from None
    return lineage


def _level(candidate: Bundle) -> tuple[float, float]:
    """The target and delta asked for the candidate (``cascade retrain`` asks for the serving
    bundle's: the delta its own gate was asked for, where one certified it): both bundles are
    weighed at them. A candidate a gate already certified holds that gate's smaller share as its
    ``delta``; what was asked is its ``asked_delta``."""
    section = candidate.manifest.calibration
    if section.mode != "agreement" or section.target is None or section.delta is None:
        raise PromoteError(f"candidate {candidate.manifest.name!r} is not calibrated for a target "
                           "agreement; calibrate it (cascade retrain does) before promoting it")
    return section.target, section.asked_delta or section.delta


Scores = dict[str, dict[str, dict[str, tuple[float, bool]]]]
"""Question -> cheap tier -> item -> (raw score, agrees with the teacher): ``item_scores``."""


def _compare(results: dict[str, CalibrationResult], scores: dict[str, Scores], ids: list[str],
             targets: tuple[float, ...]) -> Comparison:
    """Both bundles' per-item evidence on the same items, per question, through ``gate.compare``
    over ``targets``: ``scores`` on ``ids``, each bundle's cheap tiers chained as its certificate
    (``results``) serves them."""
    index = {item: k for k, item in enumerate(ids)}
    qids = sorted(set().union(*scores.values()))
    if not qids:
        raise PromoteError("no question was calibrated on the held-out items for either bundle: there is "
                           "nothing to compare; label more items and retrain")
    sides = {name: [_question(result, scores[name].get(qid, {}), index) for qid in qids]
             for name, result in results.items()}
    return compare(sides["serving"], sides["candidate"], len(ids), targets)


def _question(result: CalibrationResult, scored: dict[str, dict[str, tuple[float, bool]]],
              index: dict[str, int]) -> Question:
    """One bundle's ranking of one question's items (``scored``: tier -> item -> score, agrees):
    its routed cheap tiers as one chain."""
    dropped = result.dropped()
    by_tier = {tier: scores for tier, scores in scored.items() if tier not in dropped}
    items = sorted({item for scores in by_tier.values() for item in scores}, key=index.__getitem__)
    if not by_tier or not items:
        return Question(np.empty(0, dtype=np.int64), np.empty(0), np.empty(0, dtype=bool))
    tiers = [tier for tier in result.cheap_tiers if tier in by_tier]
    scores = np.asarray([[by_tier[t].get(i, (np.nan, True))[0] for i in items] for t in tiers])
    correct = np.asarray([[by_tier[t].get(i, (np.nan, True))[1] for i in items] for t in tiers])
    rank, agrees = chain_ranks(scores, correct)
    return Question(np.asarray([index[i] for i in items]), rank, agrees)


def _gate(results: dict[str, CalibrationResult], comparison: Comparison, delta: float, attempt: int,
          items: int, excluded: int, evaluated: int, before: dict[str, float] | None) -> Gate:
    shares = {qid: {name: 1.0 - result.cascades[qid].answered_by.get(result.teacher_tier, 1.0)
                    if qid in result.cascades else 0.0 for name, result in results.items()}
              for qid in sorted(set().union(*(result.cascades for result in results.values())))}
    mean = {name: sum(row[name] for row in shares.values()) / max(len(shares), 1) for name in results}
    served = None if before is None else sum(before.get(qid, 0.0) for qid in shares) / max(len(shares), 1)
    ours = results["candidate"]
    return Gate(target=ours.target, delta=delta, certificate=ours.certificate, items=items, excluded=excluded,
                evaluated=evaluated,
                serving_share=mean["serving"], candidate_share=mean["candidate"], shares=shares, rule=RULE,
                attempt=attempt, certificate_delta=ours.delta, alpha=comparison.alpha,
                resamples=comparison.resamples, serving_plugin=comparison.serving_share,
                candidate_plugin=comparison.candidate_share, difference=comparison.difference,
                lower_bound=comparison.lower_bound, band=comparison.targets, certified_on="held-out",
                serving_before=served)


def _reason(gate: Gate, promoted: bool, refreshed: Path | None = None, refresh: Refresh | None = None) -> str:
    figures = (f"on the same {gate.weighed()} held-out items at target {gate.target}, the candidate's cheap "
               f"tiers keep {gate.candidate_plugin:.1%} of answers {_at(gate)} and the serving bundle's "
               f"{gate.serving_plugin:.1%} (difference {gate.difference:+.1%}, {1 - (gate.alpha or 0):.0%} "
               f"paired lower bound {gate.lower_bound:+.1%}); certified at delta "
               f"{gate.certificate_delta:.4g} each (attempt {gate.attempt} against this bundle, of delta "
               f"{gate.delta}), they keep {gate.candidate_share:.1%} and {gate.serving_share:.1%}")
    if gate.evidence_after:
        figures += (f"; only items labelled after the drift alarm of {gate.evidence_after} were weighed "
                    f"({gate.set_aside} held-out items from before it set aside)")
    if promoted:
        return f"promoted: {figures}"
    kept = (f"kept aside: {figures}; a candidate replaces the serving bundle only where the lower bound "
            "is above 0")
    if refreshed is None:
        return kept
    if refresh == "kept-nothing":
        return (f"{kept}. The serving bundle's thresholds kept nothing, so it now serves the ones this gate "
                f"certified for it ({gate.serving_share:.1%} kept), from {refreshed}")
    return (f"{kept}. The serving bundle's thresholds, a gate's, keep {gate.serving_before:.1%} of these "
            f"items, so it now serves the ones this gate certified for it ({gate.serving_share:.1%} kept), "
            f"from {refreshed}: all the certificates it serves until the next promotion hold together "
            "with probability at least 1 - 0.81 delta")


def _at(gate: Gate) -> str:
    """Where the plug-in shares were read: the target, or the band up to the certificate's level."""
    if not gate.band or len(gate.band) < 2:
        return "at the target"
    return f"at targets {gate.band[0]:g} to {gate.band[-1]:.4f} (averaged)"
