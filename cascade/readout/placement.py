"""Where a GGUF model runs: GPU layers, CPU threads, context size and llama.cpp's extra buffers.

Nothing here is silent: GPU layers on a CPU build of llama.cpp are refused, not ignored.
``extra_buffers`` (or ``CASCADE_EXTRA_BUFTS``): ``"auto"`` loads without extra buffer types where
llama.cpp reports AMX (they crash the first decode: llama.cpp issue 20824) or AVX-512 (slower
there), and with them elsewhere; ``"off"`` always holds; ``"on"`` is refused where AMX is
reported; ``"force"`` loads them anyway, at the user's risk. Every answer's usage records the
choice and its reason. Details and figures: docs/placement.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from functools import cache
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from cascade.errors import ModelError

ExtraBuffers = Literal["auto", "on", "off", "force"]
EXTRA_BUFFER_SETTINGS: tuple[ExtraBuffers, ...] = ("auto", "on", "off", "force")
EXTRA_BUFFERS_ENV = "CASCADE_EXTRA_BUFTS"
CUDA_BUILD = ('CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
              'llama-cpp-python==0.3.36')
_log = logging.getLogger("cascade")


class Placement(BaseModel):
    """How to run one GGUF tier; None leaves a field to the next source (bundle default, built-in).

    ``gpu_layers``: layers offloaded to the GPU (0: CPU only; 99 puts every layer of most models
    there). ``threads``: CPU threads (None: all cores). ``n_ctx``: context tokens (None: the
    tier's own). ``extra_buffers``: see the module docstring.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_layers: int | None = Field(default=None, ge=0)
    threads: int | None = Field(default=None, ge=1)
    n_ctx: int | None = Field(default=None, ge=16)
    extra_buffers: ExtraBuffers | None = None

    def over(self, base: Placement | None) -> Placement:
        """This placement's fields where set, ``base``'s elsewhere."""
        if base is None:
            return self
        mine = self.model_dump(exclude_none=True)
        return base.model_copy(update=mine)


Placements = Placement | Mapping[str, Placement] | None
"""One placement for every GGUF tier, one per tier name, or none (each tier's default)."""


def for_tier(placements: Placements, tier: str) -> Placement | None:
    """The placement ``placements`` gives tier ``tier``, if any."""
    if placements is None or isinstance(placements, Placement):
        return placements
    return placements.get(tier)


def system_info() -> str:
    """llama.cpp's feature line for this process, e.g. ``CPU : AVX2 = 1 | AMX_INT8 = 1 | ...``."""
    import llama_cpp  # here, not at import: the command line's --help must not load llama.cpp

    info = llama_cpp.llama_print_system_info()
    return info.decode("utf-8", errors="replace") if isinstance(info, bytes) else str(info)


def reports_amx(info: str) -> bool:
    """Whether llama.cpp's feature line says it will use AMX int8 kernels."""
    return "AMX_INT8 = 1" in info


def reports_avx512(info: str) -> bool:
    return "AVX512 = 1" in info


def use_extra_buffers(setting: ExtraBuffers | None, info: str) -> tuple[bool, str]:
    """Whether to load with extra buffer types, and why (recorded where the model ran).

    Raises ``ModelError`` for "on" where llama.cpp reports AMX: refused, not crashed.
    """
    if setting in (None, "auto"):
        setting, why = _from_environment()
    else:
        why = "asked"
    if setting == "auto":
        return automatic_choice(info)
    if setting == "on" and reports_amx(info):
        raise ModelError(
            f"extra buffers 'on' refused: llama.cpp reports AMX_INT8 on this CPU, where its AMX "
            f"weight buffers segfault the first decode (llama.cpp issue 20824) and would take this "
            f"process down; use auto or off, or 'force' (--extra-buffers force, "
            f"{EXTRA_BUFFERS_ENV}=force) to load them at your own risk")
    if setting == "force":
        if reports_amx(info):
            say_once("extra buffers forced on although llama.cpp reports AMX_INT8: the first decode "
                     "may segfault this process (llama.cpp issue 20824)")
        return True, f"forced ({why})"
    return setting == "on", why


def _from_environment() -> tuple[ExtraBuffers, str]:
    """``CASCADE_EXTRA_BUFTS``'s setting (auto when unset) and how to name it in the record."""
    env = os.environ.get(EXTRA_BUFFERS_ENV, "").strip().lower()
    if env in ("", "auto"):
        return "auto", "default"
    if env not in EXTRA_BUFFER_SETTINGS:
        raise ModelError(f"{EXTRA_BUFFERS_ENV} must be auto, on, off or force; got {env!r}")
    return cast(ExtraBuffers, env), f"{EXTRA_BUFFERS_ENV}={env}"


def automatic_choice(info: str) -> tuple[bool, str]:
    """The policy's own choice for the CPU llama.cpp describes in ``info``, whatever was asked."""
    if reports_amx(info):
        say_once("llama.cpp reports AMX_INT8: loading GGUF models without extra buffer types, "
                 "since its AMX weight buffers crash on some Intel Xeons (llama.cpp issue 20824); "
                 f"{EXTRA_BUFFERS_ENV}=force loads them at your own risk")
        return False, "AMX CPU"
    if reports_avx512(info):
        return False, "AVX-512 CPU, measured faster without"
    return True, "default"


BUSY_WINDOW = 0.1
"""Seconds over which the cores other processes keep busy are measured when a model loads."""


def default_threads() -> tuple[int, str]:
    """Threads of a model loaded without ``threads``: the cores free when it loads, and why.

    llama.cpp's threads wait for each other at every step, so one busy core slows them all:
    on 2 cores the 1.5B teacher read a state 1.67x faster with 2 threads than with 1 on an idle
    machine, and 1.24x slower beside one busy process (bench/threads.py). Free cores are the
    cores less what OTHER processes keep busy NOW (``busy_elsewhere``), at least 1; the
    1-minute load average would count this program's own earlier steps and processes that have
    finished. ``ran_on`` records the figure.
    """
    cores = os.cpu_count() or 1
    busy = busy_elsewhere(BUSY_WINDOW)
    if busy is None:  # no /proc/stat: the load average, else all cores as llama.cpp would
        try:
            busy = os.getloadavg()[0]
        except OSError:
            return cores, "default: all cores"
        free = max(1, min(cores, round(cores - busy)))
        return free, f"default: free cores at load, {cores} less load {busy:.1f}"
    free = max(1, min(cores, round(cores - busy)))
    return free, f"default: free cores at load, {cores} less {busy:.1f} busy with other processes"


def busy_elsewhere(window: float) -> float | None:
    """Cores that other processes kept busy over the next ``window`` seconds: the machine's busy
    time (``/proc/stat``) less this process's own CPU time; None where /proc/stat is missing."""
    before, own = _busy_seconds(), time.process_time()
    if before is None:
        return None
    started = time.monotonic()
    time.sleep(window)
    after, own_after = _busy_seconds(), time.process_time()
    elapsed = time.monotonic() - started
    if after is None or elapsed <= 0:
        return None
    return max(0.0, (after - before - (own_after - own)) / elapsed)


def _busy_seconds() -> float | None:
    """Seconds all cores have spent busy since boot (every state but idle and iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def check_gpu_layers(gpu_layers: int) -> None:
    """Refuse GPU layers that this llama.cpp build would silently run on the CPU."""
    if gpu_layers < 0:
        raise ModelError(f"gpu layers must be 0 or more (99 offloads every layer); got {gpu_layers}")
    import llama_cpp

    if gpu_layers and not llama_cpp.llama_supports_gpu_offload():
        raise ModelError(
            f"{gpu_layers} GPU layers asked, but this llama-cpp-python build has no GPU offload "
            f"and would run on the CPU; rebuild it with CUDA ({CUDA_BUILD}) or ask for 0 GPU layers"
        )


@cache
def say_once(message: str) -> None:
    """One warning line per message and process (stderr unless logging is configured)."""
    _log.warning(message)
