"""vLLM engines in the test process, shared by the tests that build them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch


@contextlib.contextmanager
def in_process_vllm(close_engine: Callable[[], None]) -> Iterator[None]:
    """vLLM in this process (its in-process engine core and one worker: seconds to load instead of the ~40 s of a
    spawned engine), with a small cache; ``close_engine`` at the end; afterwards the process's torch threading as it
    was (the CPU worker replaces torch.set_num_threads) and transformers' config registry too: vLLM registers the
    plugin's config class for model_type "fullband", which a later test that loads an export with trust_remote_code
    in the same worker would otherwise get instead of the export's own."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    registered = dict(CONFIG_MAPPING._extra_content)
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        yield
        close_engine()
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)
    CONFIG_MAPPING._extra_content.clear()
    CONFIG_MAPPING._extra_content.update(registered)


def ragged_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    """Byte-vocabulary prompts of these lengths, the same in every test file."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]
