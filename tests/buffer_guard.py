"""A guard on the suite's own process: no test loads a GGUF there with extra buffers forced on.

Forced extra buffers segfault the first decode on Intel AMX Xeons (llama.cpp issue 20824), which
kills the whole test run. A test that needs them runs the model in a child process
(tests/test_placement.py). This guard fails, on any CPU, a test that asks for them in this process,
or that loads a GGUF outside cascade's placement policy with them on (llama.cpp's default params),
so the crash cannot come back unseen on machines without AMX. tests/conftest.py applies it to every
test; tests/test_placement.py checks that it fails such tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def no_forced_extra_buffers_in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import llama_cpp

    from cascade.readout import llama

    offences: list[str] = []
    placed: list[bool] = []  # non-empty while cascade's LlamaModel loads under the policy
    real_load, real_init = llama_cpp.llama_model_load_from_file, llama.LlamaModel.__init__

    def load(path: bytes, params: Any) -> Any:
        if params.use_extra_bufts and not placed:
            offences.append(f"{path!r} with llama.cpp's default params (extra buffers on), outside "
                            "cascade's placement policy: set params.use_extra_bufts")
        return real_load(path, params)

    def init(self: llama.LlamaModel, *args: Any, **kwargs: Any) -> None:
        placed.append(True)
        try:
            real_init(self, *args, **kwargs)
        finally:
            placed.pop()
        if self.extra_buffers and "asked" in self.extra_buffers_reason:
            offences.append(f"{self.path.name} with extra buffers {self.extra_buffers_reason}")

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", load)
    monkeypatch.setattr(llama.LlamaModel, "__init__", init)
    yield
    if offences:
        pytest.fail("loaded a GGUF with extra buffers on in the pytest process, which segfaults the "
                    "suite on Intel AMX CPUs (llama.cpp issue 20824); run it in a child process: "
                    + "; ".join(offences), pytrace=False)
