"""The option objects the offline entry points share: checked once, when made, and each bad value
named with what is allowed; the entry points refuse anything else before any work."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cascade.errors import CascadeError
from cascade.readout.placement import Placement
from distill.calibration.evaluate import evaluate_bundle
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.run import calibrate_bundle
from distill.options import CorpusInput, OptionError, RunOptions
from distill.training.run import train_bundle


@pytest.mark.parametrize("kwargs, message", [
    ({"path": 3}, "The 'path' parameter of CorpusInput must be the path (str or pathlib.Path) of a JSONL "
                  "corpus. Got 3 instead."),
    ({"text_field": ""}, "The 'text_field' parameter of CorpusInput must be a non-empty str"),
    ({"on_error": "ignore"}, "The 'on_error' parameter of CorpusInput must be 'stop' or 'skip'. Got "
                             "'ignore' instead."),
    ({"on_error": "skip"}, "The 'on_bad' parameter of CorpusInput must be a callable that receives each "
                           "skipped BadLine (for example a list's append) when on_error='skip'"),
    ({"on_bad": "print"}, "The 'on_bad' parameter of CorpusInput must be a callable"),
])
def test_a_bad_corpus_input_names_the_parameter_the_value_and_what_is_allowed(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(OptionError) as raised:
        CorpusInput(**{"path": Path("c.jsonl"), **kwargs})
    assert str(raised.value).startswith(message)
    assert isinstance(raised.value, CascadeError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("kwargs, message", [
    ({"progress": 1}, "The 'progress' parameter of RunOptions must be True or False. Got 1 instead."),
    ({"device": "gpu"}, "The 'device' parameter of RunOptions must be 'cpu' or 'cuda' or 'auto'. Got "
                        "'gpu' instead."),
    ({"placement": {"gemma": 3}}, "The 'placement' parameter of RunOptions must be a Placement, a "
                                  "mapping of tier names to Placements, or None"),
    ({"flops_per_second": 0.0}, "The 'flops_per_second' parameter of RunOptions must be a finite number "
                                "> 0, or None. Got 0.0 instead."),
    ({"cache_dir": 7}, "The 'cache_dir' parameter of RunOptions must be a folder path"),
])
def test_bad_run_options_name_the_parameter_the_value_and_what_is_allowed(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(OptionError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        RunOptions(**kwargs)


def test_options_take_paths_as_text_and_read_the_bundles_field_by_default() -> None:
    corpus = CorpusInput("c.jsonl")  # type: ignore[arg-type]
    assert corpus.path == Path("c.jsonl") and corpus.field() == "text" and corpus.field("body") == "body"
    assert CorpusInput(Path("c.jsonl"), text_field="subject").field("body") == "subject"
    assert RunOptions(cache_dir="cache").cache_dir == Path("cache")  # type: ignore[arg-type]


def test_the_entry_points_refuse_what_is_not_an_option_object_before_any_work(tmp_path: Path) -> None:
    nothing: Any = None
    with pytest.raises(OptionError, match=r"The 'corpus' parameter of train_bundle must be a CorpusInput "
                       r"\(from distill.options import CorpusInput\). Got PosixPath\('c.jsonl'\) instead."):
        train_bundle({}, Path("c.jsonl"), nothing, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="The 'run' parameter of evaluate_bundle must be a RunOptions"):
        evaluate_bundle(tmp_path, CorpusInput(Path("c.jsonl")), nothing, run={"progress": False})  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="The 'corpus' parameter of calibrate_bundle must be a CorpusInput"):
        calibrate_bundle(nothing, "c.jsonl", nothing)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="The 'options' parameter of calibrate_bundle must be a "
                       "CalibrationOptions"):
        calibrate_bundle(nothing, None, nothing, {"target": 0.9})  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"The 'batch_items' parameter of evaluate_bundle must be a whole "
                       r"number >= 1\. Got 0 instead\."):
        evaluate_bundle(tmp_path, CorpusInput(Path("c.jsonl")), nothing, batch_items=0)


def test_training_refuses_run_options_it_has_no_use_for(tmp_path: Path) -> None:
    """Training opens no GGUF tier, so a placement given to it would silently do nothing."""
    run = RunOptions(placement=Placement(gpu_layers=99))
    with pytest.raises(OptionError, match=r"The 'run.placement' parameter of train_bundle must be left at "
                       r"None \(train_bundle has no use for it\)"):
        train_bundle({}, CorpusInput(Path("c.jsonl")), None, tmp_path, run=run)  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "message"), [
    ({"certificate": "both"}, "certificate must be one of joint, split; got 'both'"),
    ({"source": "traffic"}, "source must be one of calibration, audit, both; got 'traffic'"),
    ({"teacher_items": -1}, "teacher_items must be a whole number >= 0; got -1"),
    ({"family_wise": True, "escalation_fraction": 0.2}, "family_wise splits delta"),
    ({"save": "no"}, "save must be True or False; got 'no'"),
    ({"held_out": "item-1"}, "held_out must be a collection of item ids"),
])
def test_calibration_options_are_checked_once_when_made(given: dict[str, object], message: str) -> None:
    with pytest.raises(CalibrationError, match=re.escape(message)):
        CalibrationOptions(**given)  # type: ignore[arg-type]
