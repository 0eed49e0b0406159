"""Peak RSS of the scorer beyond the model file, next to llama-cpp-python's high-level ``Llama``.

Each side runs in its own fresh process (peak RSS is per process): load the model with a 4096-token
context, answer 16 questions about one state (the scorer's fan-out; ``Llama.eval`` of one full
prompt for the baseline), then report the peak resident set minus the GGUF file's size. The
high-level class allocates an n_batch x n_vocab float32 scores array and a logits buffer for every
token of a micro-batch; the scorer asks llama.cpp for one output row per branch.

    .venv/bin/python -m bench.scorer_memory
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import argument_parser
from cascade.readout.llama import default_gguf_path

SCORER = """
import json, sys
from bench.common import many_questions, peak_rss_mib
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
s = Scorer(sys.argv[1], n_ctx=4096, max_branches=16)
s.score(parse_request({"state": "Payouts failing for three days.", "questions": many_questions(16)}))
print(json.dumps(peak_rss_mib()))
"""
IMPORTS = """
import json
from bench.common import peak_rss_mib
import llama_cpp, cascade.readout.scorer
print(json.dumps(peak_rss_mib()))
"""
LLAMA = """
import json, sys
from llama_cpp import Llama
from bench.common import peak_rss_mib, placed_llama_defaults
with placed_llama_defaults():
    m = Llama(sys.argv[1], n_ctx=4096, verbose=False)
m.eval(m.tokenize(b"Payouts failing for three days. Is this urgent? Answer:"))
print(json.dumps(peak_rss_mib()))
"""


def peak(script: str, model: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", script, model], capture_output=True, text=True, check=True
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    argument_parser(__doc__).parse_args()
    model = default_gguf_path()
    size = model.stat().st_size / 2**20
    scorer, llama = peak(SCORER, str(model)), peak(LLAMA, str(model))
    imports = peak(IMPORTS, str(model))
    print(f"model file {model.name}: {size:.0f} MiB")
    print(f"{'process':<28} {'peak RSS MiB':>12} {'beyond file':>12}")
    print(f"{'cascade Scorer (16 branches)':<28} {scorer:>12.0f} {scorer - size:>12.0f}")
    print(f"{'llama_cpp.Llama (1 prompt)':<28} {llama:>12.0f} {llama - size:>12.0f}")
    print(f"{'imports only (no model)':<28} {imports:>12.0f}")


if __name__ == "__main__":
    main()
