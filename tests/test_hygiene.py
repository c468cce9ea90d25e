"""Package hygiene: no import cycles, weight files readable as the umask allows, and resuming a finished
run changes nothing."""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import pytest
import test_train
import torch
from test_train import steps_of, tiny_raw, write_yaml

from fullband.cli import main
from fullband.config import build_config
from fullband.decoding import DecodeSettings
from fullband.model import FullBandConfig, FullBandLM
from fullband.storage import list_checkpoints
from fullband.train import train
from fullband.train.checkpoint import write_checkpoint

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "fullband"

parity_data = test_train.parity_data  # the shared prepared dataset (a session fixture)


# ---- import cycles -------------------------------------------------------------------------------


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The fullband modules ``name`` imports: at module level (run when it is imported, ``if TYPE_CHECKING``
    blocks excluded) or anywhere (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(nodes, found: set[str]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import: resolve against the importing module's package
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
            elif top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif top_level_only and isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse, found)
            else:
                visit(ast.iter_child_nodes(node), found)

    found: set[str] = set()
    visit(ast.parse(path.read_text()).body, found)
    return {m for m in found if m in modules and m != name}


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph[node]):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state and (found := visit(succ)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_has_no_cycles():
    modules = _module_names()
    assert "fullband.model" in modules and "fullband.train.trainer" in modules
    # Every import, function-level ones included, points one way between modules.
    anywhere = {name: _imports(name, path, modules, top_level_only=False) for name, path in modules.items()}
    assert _cycle(anywhere) is None, f"import cycle: {' -> '.join(_cycle(anywhere))}"
    # Importing any module first works: module-level imports, counting that importing a.b.c first runs the
    # __init__ of a and a.b (unless the importer is inside that package already), form no cycle either.
    loading = {}
    for name, path in modules.items():
        direct = _imports(name, path, modules, top_level_only=True)
        implied = {p for m in direct for p in _ancestors(m) if p != "fullband" and p not in _ancestors(name)}
        loading[name] = (direct | implied) - {name}
    assert _cycle(loading) is None, f"import cycle at import time: {' -> '.join(_cycle(loading))}"
    # The model file imports only its KV cache and its compiled steps, which import nothing: the HF export ships the
    # three files.
    assert anywhere["fullband.model"] == {"fullband.kv_cache", "fullband.compiled_steps"}
    assert anywhere["fullband.kv_cache"] == anywhere["fullband.compiled_steps"] == set()


# Modules that need an optional extra when imported (transformers, fastapi, lm-eval): the only package modules
# another module may import inside a function, so that fullband runs without the extras.
NEEDS_AN_EXTRA = {"fullband.hf.configuration_fullband", "fullband.hf.modeling_fullband", "fullband.serve.app",
                  "fullband.lm_eval", "fullband.vllm.config", "fullband.vllm.rollouts"}


def test_package_imports_sit_at_the_top_but_for_optional_extras():
    """An import of the package inside a function (or under TYPE_CHECKING) hides the architecture and import
    cycles; only the modules that need an optional extra are imported late. ``decoding.py``'s guarded import
    is the copy an export ships, where the package may be absent."""
    modules = _module_names()
    late = []
    for name, path in modules.items():
        everywhere = _imports(name, path, modules, top_level_only=False)
        at_top = _imports(name, path, modules, top_level_only=True)
        late += [f"{name} imports {m} late" for m in sorted(everywhere - at_top - NEEDS_AN_EXTRA)
                 if not (m in at_top or any(m.startswith(t + ".") for t in at_top))]
    assert not late, late
    assert NEEDS_AN_EXTRA <= set(modules)  # no stale names


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# The modules that drive training, so may import fullband.train: the command line and ``python -m fullband``
# (``fullband train``), ``fullband sft``, ``fullband demo`` and ``fullband rl`` (they train models; the rl package's
# inference side, rollout log-probabilities, rewards and the loss, does not).
TRAINING_DRIVERS = {"fullband.__main__", "fullband.cli", "fullband.sft", "fullband.tools.demo", "fullband.rl.trainer",
                    "fullband.rl.cli"}


def _path_to_train(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import chain [start, ..., fullband.train.x] from ``start`` into fullband.train, or None."""
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == "fullband.train" or node.startswith("fullband.train."):
            chain = [node]
            while parents[chain[-1]] is not None:
                chain.append(parents[chain[-1]])
            return chain[::-1]
        for succ in sorted(graph.get(node, ())):
            if succ not in parents:
                parents[succ] = node
                queue.append(succ)
    return None


def test_only_training_drivers_import_the_trainer():
    """The layers: ``fullband.train`` (the loop, its objective, optimizers and checkpoint writing) sits on top
    of the model, data, config, pass schedule (``fullband.schedule``) and model storage (``fullband.storage``).
    Everything that loads or runs a model (loading, generation, serve, bench, hf, lm_eval, eval, jacobi, probe,
    chat_cli, ...) sits beside the trainer and must not need it: no module outside ``fullband/train/`` but the
    ``TRAINING_DRIVERS`` imports ``fullband.train``, directly or through other modules (a driver included),
    at module level or inside a function. Importing ``a.b.c`` runs ``a.b``'s ``__init__`` too, so it counts."""
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        direct = _imports(name, path, modules, top_level_only=False)
        graph[name] = direct | {p for m in direct for p in _ancestors(m) if p != "fullband"}
    trainer = {m for m in modules if m == "fullband.train" or m.startswith("fullband.train.")}
    assert "fullband.train.trainer" in trainer and TRAINING_DRIVERS <= set(modules)  # no stale names
    offenders = {name: chain for name in sorted(set(modules) - trainer - TRAINING_DRIVERS)
                 if (chain := _path_to_train(graph, name)) is not None}
    assert not offenders, "modules that reach fullband.train: " + "; ".join(
        " -> ".join(chain) for chain in offenders.values())
    assert _path_to_train({"a": {"b"}, "b": {"fullband.train.x"}}, "a") == ["a", "b", "fullband.train.x"]


# ---- file permissions ----------------------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _assert_modes(root: Path, umask: int, skip: str | None = None) -> list[str]:
    """Every file under root (but those with ``skip`` in their path) has mode 0o666 & ~umask; returns the
    relative file names checked."""
    names = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not (skip and skip in str(path.relative_to(root))):
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == 0o666 & ~umask, f"{path.relative_to(root)}: mode {oct(mode)}, umask {oct(umask)}"
            names.append(str(path.relative_to(root)))
    return names


def _tiny_model() -> FullBandLM:
    torch.manual_seed(0)
    return FullBandLM(FullBandConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16))


def test_save_pretrained_and_checkpoints_follow_the_umask(tmp_path, umask):
    model = _tiny_model()
    model.save_pretrained(tmp_path / "model")
    assert "model.safetensors" in _assert_modes(tmp_path / "model", umask)

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    write_checkpoint(tmp_path / "run", 3, model.state_dict(), model.config, DecodeSettings.of(model), tokenizer,
                     {"state": {}, "param_groups": []}, {"step": 3}, keep=2)
    names = _assert_modes(tmp_path / "run" / "checkpoints", umask)
    assert {"step_00000003/model/model.safetensors", "step_00000003/optimizer.pt",
            "step_00000003/manifest.json"} <= set(names)


def test_hf_export_and_convert_follow_the_umask(tmp_path, umask):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullband.hf import convert_from_hf, export_hf

    _tiny_model().save_pretrained(tmp_path / "model")
    export_hf(tmp_path / "model", tmp_path / "export")
    assert "model.safetensors" in _assert_modes(tmp_path / "export", umask)

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    convert_from_hf(tmp_path / "llama", tmp_path / "converted")
    assert "model.safetensors" in _assert_modes(tmp_path / "converted", umask)


# ---- resuming a finished run ---------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _eval_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines() if line]


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, parity_data, capsys):
    previous = os.umask(0o027)
    try:
        raw = tiny_raw(train={"tokens": steps_of(2), "eval_every": 1})
        run = tmp_path / "run"
        train(build_config(raw), run, data_dir=parity_data)
        # the trainer's own files follow the umask too (copies of the dataset's tokenizer keep their mode)
        assert "checkpoints/step_00000002/model/model.safetensors" in _assert_modes(run, 0o027, skip="tokenizer")
    finally:
        os.umask(previous)
    assert _eval_steps(run) == [1, 2]
    before = _snapshot(run)
    capsys.readouterr()

    code = main(["train", "--out-dir", str(run), "--data-dir", str(parity_data), "--resume"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"{run} is already complete: step 2 of 2" in err and "nothing was changed" in err
    assert "steps 2, tokens" in out and "standard" in out  # the summary and the final evaluation's table
    assert _snapshot(run) == before

    # A run whose final evaluation was cut short (checkpoint written, eval line missing) evaluates once.
    lines = (run / "eval.jsonl").read_text().splitlines(keepends=True)
    (run / "eval.jsonl").write_text("".join(lines[:-1]))
    config = write_yaml(tmp_path / "config.yaml", raw)
    assert main(["train", "--config", str(config), "--out-dir", str(run), "--data-dir", str(parity_data),
                 "--resume"]) == 0
    assert "is already complete" not in capsys.readouterr().err
    assert _eval_steps(run) == [1, 2]
    assert (run / "eval.jsonl").read_text() == "".join(lines)  # the same evaluation, bitwise
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002"]
