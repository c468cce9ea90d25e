"""The recurrence's token steps under ``torch.compile`` (``FullBandLM.compile_recurrence``), with what makes them
cheap on a CPU: inductor's C++ wrapper, and dynamo's trace kept on disk beside the kernels (torch's caching
precompile), so that a later run loads the compiled chunk instead of tracing it again."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch


class CompiledSteps:
    """``function`` compiled once per shape (``fullgraph``, static shapes). With inductor on a CPU (torch >= 2.8):
    a call's few hundred small kernels run from the C++ wrapper, not a line of Python each (10-15% of a step; the
    same kernels, so the same losses), built apart from them, which compiles as fast; and each new trace is written
    to inductor's cache directory with its forward and backward, where a later process's ``CompiledSteps`` finds it
    (its sources and torch unchanged): on a warm cache the state-tracking preset's first step, the load included,
    takes 2.4 s where tracing it again took 5.3-6.8 (benchmarks/first_step.py). Not measured on a GPU, so not used
    there."""

    def __init__(self, function: Callable[..., Any], backend: str, device: torch.device) -> None:
        from torch._dynamo import config as dynamo_config  # torch.compile's own modules, loaded when it is used
        from torch._dynamo.utils import counters
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        separate = "cpp_wrapper_build_separate"
        cpp = backend == "inductor" and device.type == "cpu" and hasattr(inductor_config, separate)
        self.keeps_trace = (cpp and hasattr(dynamo_config, "caching_precompile")
                            and hasattr(functorch_config, "force_non_lazy_backward_lowering")
                            and functorch_config.enable_autograd_cache
                            and not torch.compiler.config.force_disable_caches)
        if self.keeps_trace:
            _quiet_trace_notes()
        loaded, stale = counters["dynamo_cache"]["dynamo_cache_hit"], _TRACE_NOTES.stale
        with self._settings():
            self.compiled = torch.compile(function, backend=backend, dynamic=False, fullgraph=True,
                                          options={"cpp_wrapper": True, separate: True} if cpp else None)
        # A trace of other sources (fullband or torch changed since) or an unreadable one is traced anew and replaced.
        self.trace_found = counters["dynamo_cache"]["dynamo_cache_hit"] > loaded and _TRACE_NOTES.stale == stale
        if self.keeps_trace:
            _past_loaded_names(function.__globals__)

    def describe(self) -> str:
        """What the first call will do, for a run's log: a cold compile takes a minute or more on a CPU."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        if self.trace_found:
            return (f"the steps traced and compiled by an earlier run were found in {cache_dir()} (a model of other "
                    "shapes compiles at its first step)")
        kept = f", and are kept in {cache_dir()} for later runs" if self.keeps_trace else ""
        return f"the steps compile at the first step (a minute or more the first time on a CPU){kept}"

    def __call__(self, *args: Any) -> Any:
        from torch._dynamo.utils import counters

        with self._settings():
            before = _traces_and_graphs(counters)
            result = self.compiled(*args)
            traced, graphs = (after - earlier for after, earlier in zip(_traces_and_graphs(counters), before))
            # Only with its compiled graphs, which the autograd cache hands over: a trace written without them would
            # be loaded and skipped by every later run.
            if self.keeps_trace and traced and graphs:
                self._write_trace()
        return result

    def _write_trace(self) -> None:
        """The new trace (and the loaded ones) to disk; where it cannot be written, the steps run on, traced anew by
        later runs."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        try:
            torch.compiler.save_cache_artifacts()
        except (OSError, RuntimeError) as error:  # torch reports a failed write as a RuntimeError
            warnings.warn(f"compile_recurrence: could not keep the compiled steps' trace in {cache_dir()} ({error}); "
                          "later runs will trace them again (set TORCHINDUCTOR_CACHE_DIR to a writable directory)",
                          stacklevel=4)

    @contextlib.contextmanager
    def _settings(self) -> Iterator[None]:
        """torch.compile's settings for these steps alone: the trace kept, the backward compiled with the forward
        (not at the first backward), so that the trace is written with both."""
        if not self.keeps_trace:
            yield
            return
        with torch._dynamo.config.patch(caching_precompile=True), \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            yield


def _traces_and_graphs(counters: Any) -> tuple[int, int]:
    """How many graphs dynamo traced and how many compiled graphs the autograd cache stored or found, so far."""
    cache = counters["aot_autograd"]
    return counters["stats"]["unique_graphs"], cache["autograd_cache_saved"] + cache["autograd_cache_hit"]


class _TraceNotes(logging.Filter):
    """torch's notes on a kept trace, none the user's to act on: a log line for each guard it leaves out (on the
    identity of the functions it calls, torch.cat, F.silu, ..., which a later process has anew), and a traceback for
    a kept trace it cannot use (its sources or torch changed since, or the file is unreadable), which is then traced
    anew and replaced: counted in ``stale``."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(("Failed to load entry from dynamo cache", "Failed to load package from path")):
            self.stale += 1
            return False
        return "is dropped with caching_precompile" not in message


_TRACE_NOTES = _TraceNotes()


def _quiet_trace_notes() -> None:
    """_TRACE_NOTES on the loggers of dynamo's guards, its cache and its entry point; and the keeping of guards reads
    tensors' .grad, which warns."""
    for name in ("torch._dynamo.guards", "torch._dynamo.package", "torch._dynamo.eval_frame"):
        logging.getLogger(name).addFilter(_TRACE_NOTES)
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                            module=r"torch\._dynamo\.guards")


def _past_loaded_names(scope: dict[str, Any]) -> None:
    """A loaded trace puts its globals in the function's module under names dynamo numbers from a counter of its
    process, so a new trace in this one (a model of other shapes) would make one of them again and fail ("Name
    '__builtins_dict___0' already exists in scope", torch 2.13): the counter moves past them."""
    from torch._dynamo.bytecode_transformation import unique_id

    prefix = "__builtins_dict___"
    loaded = [int(name[len(prefix):]) for name in scope if name.startswith(prefix) and name[len(prefix):].isdigit()]
    while loaded and int(unique_id("")[1:]) < max(loaded):
        pass
