"""Rendering the calibration report's page: the jinja2 template against the f-strings it replaced.

``cascade calibrate`` writes report.html through ``render_page(report_page(...))``: a
``ReportPage`` of formatted values laid out by the package's autoescaped template. Before, the page
was built in f-strings with ``html.escape`` called by hand; that code is kept below ONLY as the
baseline (``_old_page`` and its helpers, copied from distill/reports/calibration_report.py as it
was before the template). Both render the same real report: the demo's generated support
messages (``distill.demo.synthetic``, the generator's labels as the teacher), the encoder tier
trained on the train part and calibrated on the calibration part, its figures drawn once.

It prints, per contender: the milliseconds of one page (median over ``--rounds`` rounds of
``--renders`` renders each, the two taking turns in every round, wall and CPU time) and the
median of per-round ratios; the first render in a fresh process (the template's load and compile
included; jinja2 itself is imported by ``distill.calibration.run`` either way), median of
``--fresh`` processes taking turns; and the whole report step that ``cascade calibrate`` times
(drawing the figures, then the page), ``--step-rounds`` rounds taking turns.

    .venv/bin/python -m bench.report_render --items 600 --rounds 15 --renders 20 --fresh 5 --step-rounds 4
"""

from __future__ import annotations

import html
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import CACHE_DIR, CLOCKS, argument_parser, in_rounds, median_ratio

FIRST_RENDER = """
import json, sys, time
from pathlib import Path
from bench.report_render import load, render_new, render_old
result, bundle, data, figures = load(Path(sys.argv[1]))
render = render_new if sys.argv[2] == "template" else render_old
begin = time.perf_counter()
render(result, bundle, data, figures)
print(json.dumps(time.perf_counter() - begin))
"""


def build(root: Path, items: int) -> None:
    """A calibrated bundle under ``root``, with its result as JSON and its report written once."""
    from cascade.bundle.manifest import Bundle
    from cascade.corpus import load_questions
    from cascade.encoder.onnx_encoder import Encoder
    from distill.calibration.options import CalibrationOptions
    from distill.calibration.run import calibrate_bundle
    from distill.demo.synthetic import generate, write_corpus, write_labels, write_questions
    from distill.labelling.transfer import import_labels
    from distill.options import CorpusInput, RunOptions
    from distill.reports.calibration_report import write_report
    from distill.store import LabelStore, Teacher
    from distill.training.run import train_bundle

    encoder, generated = Encoder(), generate(items, 0)
    corpus = write_corpus(generated, root / "corpus.jsonl")
    questions = load_questions(write_questions(root / "questions.json"))
    with LabelStore(root / "labels.sqlite", Teacher(kind="external", model="generator")) as store:
        import_labels(store, write_labels(generated, root / "labels.jsonl"), questions)
        bundle = train_bundle(questions, CorpusInput(corpus), store, root / "bundle", encoder=encoder,
                              run=RunOptions(progress=False, cache_dir=CACHE_DIR))
        result = calibrate_bundle(bundle, CorpusInput(corpus), store,
                                  CalibrationOptions(target=0.9, delta=0.1), encoder=encoder,
                                  run=RunOptions(progress=False, flops_per_second=1e11))
    (root / "result.json").write_text(result.model_dump_json(), encoding="utf-8")
    write_report(result, Bundle.load(bundle.directory), root / "report")


def load(root: Path) -> tuple[Any, Any, dict[str, Any], list[Any]]:
    """(result, bundle, report.json's data, figures) of the report ``build`` wrote."""
    from cascade.bundle.manifest import Bundle
    from distill.calibration.results import CalibrationResult
    from distill.reports.figures import draw_figures

    result = CalibrationResult.model_validate_json((root / "result.json").read_text(encoding="utf-8"))
    bundle = Bundle.load(root / "bundle")
    data = json.loads((root / "report" / "report.json").read_text(encoding="utf-8"))
    keys = {qid: q.option_keys() for qid, q in bundle.manifest.parsed_questions().items()}
    teacher = next(row for row in data["costs"] if row["kind"] == "teacher")["seconds_per_decision"]
    return result, bundle, data, draw_figures(result, keys, teacher)


def render_new(result: Any, bundle: Any, data: dict[str, Any], figures: list[Any]) -> str:
    from distill.reports.calibration_report import render_page, report_page

    return render_page(report_page(result, bundle, data, figures))


def render_old(result: Any, bundle: Any, data: dict[str, Any], figures: list[Any]) -> str:
    return _old_page(result, bundle, data, figures)


def first_renders(root: Path, fresh: int) -> dict[str, list[float]]:
    """Seconds of the first render in a fresh process, per contender, the two taking turns."""
    seconds: dict[str, list[float]] = {"f-strings": [], "template": []}
    for turn in range(fresh):
        for name in sorted(seconds, reverse=turn % 2 == 1):
            done = subprocess.run([sys.executable, "-c", FIRST_RENDER, str(root), name], capture_output=True,
                                  text=True, check=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
            seconds[name].append(json.loads(done.stdout))
    return seconds


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=600, help="generated messages")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--renders", type=int, default=20, help="renders of each contender per round")
    parser.add_argument("--fresh", type=int, default=5, help="fresh processes per contender")
    parser.add_argument("--step-rounds", type=int, default=4, help="rounds of the whole report step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cascade-report-render-") as work:
        root = Path(work)
        build(root, args.items)
        result, bundle, data, figures = load(root)
        renders = {"f-strings": render_old, "template": render_new}
        pages = {name: render(result, bundle, data, figures) for name, render in renders.items()}
        same = pages["f-strings"].replace("&#x27;", "&#39;").replace("&quot;", "&#34;") == pages["template"]
        n = range(args.renders)
        calls = {name: lambda render=render: [render(result, bundle, data, figures) for _ in n]
                 for name, render in renders.items()}
        page = in_rounds(calls, args.rounds, CLOCKS, rotate=True)
        steps = {name: lambda render=render: render(*load(root)) for name, render in renders.items()}
        step = in_rounds(steps, args.step_rounds, CLOCKS, rotate=True)
        fresh = first_renders(root, args.fresh)
    print(f"report of {len(result.calibrations)} (question, tier) fits, {len(figures)} figures, "
          f"{len(pages['template']) / 1024:.0f} KiB; pages identical but for the quote entity: {same}")
    print(f"{'contender':<10} {'page wall ms':>12} {'page cpu ms':>12} {'first, fresh process ms':>24} "
          f"{'report step wall ms':>20} {'report step cpu ms':>19}")
    for name in renders:
        one = {c: _ms(page[name][c]) / args.renders for c in CLOCKS}
        print(f"{name:<10} {one['wall']:>12.2f} {one['cpu']:>12.2f} "
              f"{_ms(fresh[name]):>24.1f} {_ms(step[name]['wall']):>20.0f} {_ms(step[name]['cpu']):>19.0f}")
    ratio = {what: {c: median_ratio(per["template"][c], per["f-strings"][c]) for c in CLOCKS}
             for what, per in (("page", page), ("report step", step))}
    first = _ms(fresh["template"]) / _ms(fresh["f-strings"])
    print("template / f-strings, median of per-round ratios: "
          + "; ".join(f"{what} wall {r['wall']:.3f}, cpu {r['cpu']:.3f}" for what, r in ratio.items())
          + f"; first render {first:.2f}x")


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


# -- BASELINE ONLY: the f-string page that the template replaced ----------------------------------
# Copied from distill/reports/calibration_report.py before the template (types loosened to Any,
# _status inlined); kept here only to measure against, never imported by the package.

def _old_page(result: Any, bundle: Any, data: dict[str, Any], figures: list[Any]) -> str:
    from distill.reports.calibration_report import _NOT_PROMISED, _items_text

    questions = bundle.manifest.parsed_questions()
    shown = {fit.question for fit in result.calibrations} | set(result.cascades)
    sections = [_question_section(qid, questions[qid].type, questions[qid].instructions, result, figures)
                for qid in questions if qid in shown]
    scope = "for all questions at once" if result.family_wise else "per question"
    mode = (f"target agreement {result.target:.4g}, delta {result.delta:.3g} {scope}"
            if result.escalation_fraction is None
            else f"budget mode: escalation fraction {result.escalation_fraction:.3g}")
    return _TEMPLATE.format(
        name=_e(result.name), bundle=_e(result.bundle), mode=_e(mode), items=_e(_items_text(result)),
        temperature=f"{result.temperature_share:.0%}", rest=f"{1 - result.temperature_share:.0%}",
        tiers=_e(" -> ".join([*(f"{name} (taken out)" if name in result.dropped() else name
                                for name in result.cheap_tiers), result.teacher_tier])),
        guarantee=_e(data["guarantee"]),
        not_promised="".join(f"<li>{_e(text)}</li>" for text in _NOT_PROMISED),
        summary=_summary_table(data["summary"]), costs=_costs_table(data["costs"]),
        payoffs="".join(f'<p class="message {"ok" if p.kept else "warn"}"><b>tier {_e(tier)}:</b> '
                        f'{_e(p.reason)}</p>' for tier, p in result.payoffs.items()) + _traffic_note(result),
        cost_assumption=_e(data["cost_assumption"]), sections="\n".join(sections),
        figures_note=(f'\n<p class="message warn">{_e(data["figures_note"])}</p>'
                      if "figures_note" in data else ""),
        teacher_check=_teacher_check_box(result),
    )


def _traffic_note(result: Any) -> str:
    traffic = result.teacher_traffic
    if traffic is None or not traffic.items:
        return ""
    return f'<p class="message ok">On the certifying items, {_e(traffic.line())}.</p>'


def _teacher_check_box(result: Any) -> str:
    if not result.teacher_checks:
        return ""
    flagged = [check for check in result.teacher_checks if check.flagged]
    head = ("<h2>The teacher check: DEGENERATE LABELS</h2><p>These questions were certified only "
            "because the check was overridden (--accept-degenerate-teacher): agreement with this "
            "teacher says nothing about them.</p>" if flagged else "<h2>The teacher check</h2>")
    rows = "".join(f'<p class="message {"warn" if c.flagged else "ok"}">{_e(c.line())}</p>'
                   for c in result.teacher_checks)
    return f'<div class="box">{head}{rows}</div>'


def _question_section(qid: str, qtype: str, instructions: Any, result: Any, figures: list[Any]) -> str:
    parts = [f'<section id="q-{_e(qid)}"><h2>{_e(qid)} <span class="type">{_e(qtype)}</span></h2>',
             f'<p class="instructions">{_e(str(instructions))}</p>']
    for fit in (f for f in result.calibrations if f.question == qid):
        out = (" It was taken out of the cascade: it costs more than it saves (see Costs)."
               if fit.tier in result.dropped() else "")
        status = "warn" if out else ("ok" if fit.threshold is not None else "warn")
        parts.append(f'<p class="message {status}"><b>tier {_e(fit.tier)}:</b> '
                     f'{_e(fit.message)}{_e(out)}</p>')
        if fit.temperature_note:
            parts.append(f'<p class="message warn">tier {_e(fit.tier)}: temperature not fitted: '
                         f'{_e(fit.temperature_note)}; the confidences answers report are the raw '
                         f'ones (ECE {fit.ece_after:.3f})</p>')
    for tier, cost in result.costs.items():
        counts = cost.inputs.get(qid)
        if counts is not None and (line := counts.line(tier)):
            parts.append(f'<p class="message warn">{_e(line)}</p>')
    imgs = "".join(_img(f) for f in figures if f.question == qid)
    parts.append(f'<div class="grid">{imgs}</div></section>' if imgs else "</section>")
    return "\n".join(parts)


def _img(figure: Any) -> str:
    return (f'<figure><img src="data:image/png;base64,{figure.png}" id="{_e(figure.id)}" '
            f'alt="{_e(figure.title)}"></figure>')


def _summary_table(rows: list[dict[str, Any]]) -> str:
    head = ("question", "type", "tier", "n (of which T fitted on)", "T", "ECE before", "ECE after",
            "threshold", "kept", "escalated", "agreement", "lower bound", "guarantee reached?")
    body = []
    for row in rows:
        if "n" not in row:
            body.append(f"<tr><td>{_e(row['question'])}</td><td>{_e(row['type'])}</td>"
                        f"<td>{_e(row['tier'])}</td><td colspan=\"10\" class=\"warn\">"
                        f"not calibrated: {_e(row['message'])}</td></tr>")
            continue
        n = f"{row['n']} ({row['n_temperature']})"
        cells = (row["question"], row["type"], row["tier"], n, f"{row['temperature']:.3g}",
                 f"{row['ece_before']:.3f}", f"{row['ece_after']:.3f}", _fmt(row["threshold"], ".4g"),
                 f"{row['kept_share']:.1%}", f"{row['escalation_rate']:.1%}", f"{row['agreement']:.4f}",
                 f"{row['lower_bound']:.4f}", row["guarantee"])
        css = "ok" if row["threshold"] is not None and "taken out" not in row["guarantee"] else "warn"
        body.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells[:-1])
                    + f'<td class="{css}">{_e(cells[-1])}</td></tr>')
    return _table(head, body)


def _costs_table(rows: list[dict[str, Any]]) -> str:
    head = ("tier", "kind", "source", "states", "tokens / state", "s / state", "s / token", "ms / decision")
    body = []
    for row in rows:
        cells = (row["tier"], row["kind"], row["source"], _fmt(row["states"], "d"),
                 f"{row['tokens_per_state']:.1f}", f"{row['seconds_per_state']:.3g}",
                 f"{row['seconds_per_token']:.3g}", f"{row['seconds_per_decision'] * 1e3:.2f}")
        body.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return _table(head, body)


def _table(head: tuple[str, ...], body: list[str]) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Calibration report: {name}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; padding: 1.5rem;
       max-width: 1200px; color: #222; line-height: 1.45; }}
h1 {{ margin-bottom: 0.2rem; }}
h2 {{ border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }}
.meta {{ color: #555; margin-top: 0; }}
.box {{ background: #f5f8fb; border-left: 4px solid #2471a3; padding: 0.6rem 1rem; margin: 1rem 0; }}
table {{ border-collapse: collapse; width: 100%; font-size: 0.85rem; margin: 0.5rem 0; }}
th, td {{ border: 1px solid #ddd; padding: 0.25rem 0.45rem; text-align: left; vertical-align: top; }}
th {{ background: #f0f0f0; }} td:nth-child(n+4) {{ font-variant-numeric: tabular-nums; }}
.ok {{ color: #1e7b34; }} .warn {{ color: #a04000; }}
.type {{ font-size: 0.8rem; font-weight: normal; color: #fff; background: #777; border-radius: 3px;
         padding: 0.05rem 0.4rem; vertical-align: middle; }}
.instructions {{ font-style: italic; }} .note {{ color: #555; font-size: 0.9rem; }}
.grid {{ display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 0.8rem; }}
figure {{ margin: 0; }} figure img {{ width: 100%; height: auto; border: 1px solid #eee; }}
</style></head>
<body>
<h1>Calibration report: {name}</h1>
<p class="meta">Bundle {bundle}<br>Cascade {tiers}; {mode}; {items}
(all of them certify the thresholds, on each tier's raw margin: its top probability's lead over
the runner-up; {temperature} of them fit the temperatures, whose reliability diagrams are drawn
on the other {rest}).</p>
{teacher_check}
<div class="box"><h2>What the guarantee means</h2><p>{guarantee}</p>
<p>What it does not promise:</p><ul>{not_promised}</ul></div>
<h2>Summary</h2>
{summary}
<h2>Costs</h2>
{costs}
{payoffs}
<p class="note">{cost_assumption}</p>{figures_note}
{sections}
</body></html>
"""


if __name__ == "__main__":
    main()
