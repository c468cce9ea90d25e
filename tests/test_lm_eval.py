"""lm-evaluation-harness adapter: decode/prefill scoring against teacher-forced generation and multipass,
real lm-eval runs (multiple choice, perplexity, generation) on local task YAMLs over local JSON files, the
stock ``hf`` model on an export, and clear errors. Everything offline."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os

# lm-eval reads datasets and may consult the Hub: these tests use local JSON files only, and must never
# reach the network (datasets reads these variables when it is imported).
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import make_model, reference_decode  # noqa: E402

import fullband.engine as engine  # noqa: E402
from fullband.generation import generate, score_continuations  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXTS = [[256, 5, 17, 33, 2, 40], [256, 9], [256, 44, 61, 3, 3, 50, 12, 7, 8, 1]]
CONTINUATIONS = [[11, 12, 13, 14], [60], [1, 2, 3, 4, 5, 6, 7]]
MODES = [("standard", 1), ("soft", 1), ("fused", 2), ("fused", "auto")]


@contextlib.contextmanager
def forced_sampler(tokens: torch.Tensor):
    """Make ``generate`` feed back ``tokens[:, step]`` (teacher forcing) and record the logits it samples from."""
    seen: list[torch.Tensor] = []

    def forced(logits, *args, **kwargs):
        seen.append(logits.detach().clone())
        return tokens[:, len(seen) - 1].clone()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "sample_rows", forced)
        yield seen


def lively_model(**overrides):
    """A tiny byte-vocabulary model whose fed-back state matters (larger fusion weights than the init)."""
    model = make_model(**{"vocab_size": 259, "max_seq_len": 64, **overrides})
    with torch.no_grad():
        for p in model.fusion.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return model


# --------------------------------------------------------------------------------------------------
# Scoring


@pytest.mark.parametrize("mode,passes", MODES)
def test_decode_scoring_equals_teacher_forced_generate(mode, passes):
    model = lively_model()
    kw = dict(mode=mode, fused_passes=passes, fused_tol=0.05, fused_max_passes=4)
    scores = score_continuations(model, CONTEXTS, CONTINUATIONS, scoring="decode", **kw)
    L = max(map(len, CONTINUATIONS))
    forced = torch.zeros(len(CONTINUATIONS), L, dtype=torch.long)
    for i, c in enumerate(CONTINUATIONS):
        forced[i, : len(c)] = torch.tensor(c)
    with forced_sampler(forced) as seen:
        generate(model, CONTEXTS, L, **kw)  # the ragged batch, as generate runs it
    steps = torch.stack(seen, dim=1).log_softmax(-1)  # (B, L, V)
    for i, (cont, (logprobs, greedy)) in enumerate(zip(CONTINUATIONS, scores)):
        expected = steps[i, torch.arange(len(cont)), torch.tensor(cont)]
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
        assert torch.equal(greedy, steps[i, : len(cont)].argmax(-1) == torch.tensor(cont))
        # And each row alone gives the same numbers (batching does not change a row's score).
        (alone, _), = score_continuations(model, [CONTEXTS[i]], [cont], scoring="decode", **kw)
        torch.testing.assert_close(alone, logprobs, atol=1e-5, rtol=0)


def test_decode_scoring_modes_differ():
    model = lively_model()
    totals = {m: sum(float(lp.sum()) for lp, _ in score_continuations(model, CONTEXTS, CONTINUATIONS, mode=m))
              for m in ("standard", "soft", "fused")}
    assert len({round(v, 4) for v in totals.values()}) == 3, totals


@pytest.mark.parametrize("passes", [0, 1, 3])
def test_prefill_scoring_is_the_multipass_loss(passes):
    model = lively_model()
    mode = dict(mode="fused", fused_passes=passes) if passes else dict(mode="standard")
    scores = score_continuations(model, CONTEXTS, CONTINUATIONS, scoring="prefill", **mode)
    for (ctx, cont), (logprobs, _) in zip(zip(CONTEXTS, CONTINUATIONS), scores):
        ids = torch.tensor([ctx + cont[:-1]])
        with torch.no_grad():
            logits = model.multipass(ids, passes=passes + 1).logits[-1][0]
        expected = logits[-len(cont):].log_softmax(-1)[torch.arange(len(cont)), torch.tensor(cont)]
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)


def test_scoring_errors():
    model = lively_model()
    with pytest.raises(ValueError, match="exceed the model's max_seq_len 64"):
        score_continuations(model, [[1] * 60], [[2] * 10])
    with pytest.raises(ValueError, match="at least one token"):
        score_continuations(model, [[1]], [[]])
    with pytest.raises(ValueError, match="unknown scoring"):
        score_continuations(model, [[1]], [[2]], scoring="parallel")


# --------------------------------------------------------------------------------------------------
# lm-eval end to end

MC_DOCS = [
    {"question": "the cat", "choices": ["sat", "ran", "ate"], "answer": 0},
    {"question": "a dog", "choices": ["slept", "barked"], "answer": 1},
    {"question": "blue", "choices": ["sky", "sea", "ink", "car"], "answer": 2},
    {"question": "one two", "choices": ["three", "four"], "answer": 0},
    {"question": "warm", "choices": ["sun", "tea", "bed"], "answer": 1},
    {"question": "x", "choices": ["y", "z"], "answer": 1},
]
PPL_DOCS = [{"text": "the cat sat on the mat"}, {"text": "seven dogs ran past quickly and slept " * 4}]
GEN_DOCS = [{"prompt": "Q: 1+1=", "answer": "2"}, {"prompt": "Q: say hi", "answer": "hi"}]


def write_tasks(root, gen_kwargs: str = "until: ['\\n', 'Q:']\n  max_gen_toks: 12\n  do_sample: false") -> str:
    """Three lm-eval task YAMLs over local JSON-lines files (lm-eval's json dataset builder)."""
    for name, docs in (("mc", MC_DOCS), ("ppl", PPL_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "fb_mc.yaml").write_text(
        f"task: fb_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (root / "fb_ppl.yaml").write_text(
        f"task: fb_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (root / "fb_gen.yaml").write_text(
        f"task: fb_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  {gen_kwargs}\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return str(root)


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    from fullband.data.tokenizers import ByteTokenizer

    root = tmp_path_factory.mktemp("lmeval")
    model = lively_model()
    model.save_pretrained(root / "model")
    ByteTokenizer().save(root / "model" / "tokenizer")
    tasks = write_tasks(root)
    return root, model, tasks


def run_lm_eval(model: str, model_args: str, tasks_dir: str, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import fullband.lm_eval  # noqa: F401  (registers the model)

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(
        include_path=tasks_dir, include_defaults=False), log_samples=True, bootstrap_iters=0, random_seed=0)


def independent_logprob(model, context: list[int], continuation: list[int], mode: str, passes: int = 1) -> float:
    """log p(continuation | context) by uncached recomputation of the whole sequence at every step."""
    _, logits = reference_decode(model, torch.tensor([context]), len(continuation), mode, fused_passes=passes,
                                 forced=torch.tensor(continuation))
    return float(logits.log_softmax(-1)[torch.arange(len(continuation)), torch.tensor(continuation)].double().sum())


def test_import_registers_the_model():
    from lm_eval.api.registry import get_model

    import fullband.lm_eval

    assert get_model("fullband") is fullband.lm_eval.FullbandLM
    assert fullband.lm_eval.lm_eval_utils.__name__ == "lm_eval.utils"  # the real package, not this module


def test_simple_evaluate_three_tasks_soft(byte_model_dir):
    root, model, tasks = byte_model_dir
    out = run_lm_eval("fullband", f"pretrained={root / 'model'},decode_mode=soft,device=cpu,batch_size=4", tasks,
                      ["fb_mc", "fb_ppl", "fb_gen"])
    res = out["results"]
    assert set(res["fb_ppl"]) >= {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"}
    assert "exact_match,none" in res["fb_gen"]

    # Multiple choice: accuracy from our own uncached computation of each choice's log-probability.
    bos = 256
    correct = 0
    for doc, sample in zip(MC_DOCS, sorted(out["samples"]["fb_mc"], key=lambda s: s["doc_id"])):
        ctx = [bos] + list(doc["question"].encode())
        lls = [independent_logprob(model, ctx, list((" " + c).encode()), "soft") for c in doc["choices"]]
        reported = [r[0][0] for r in sample["resps"]]
        assert reported == pytest.approx(lls, abs=1e-4)
        correct += max(range(len(lls)), key=lls.__getitem__) == doc["answer"]
    assert res["fb_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))

    # Perplexity: the short document fits one window; its total is the BOS-conditioned log-probability.
    short = PPL_DOCS[0]["text"]
    ll = independent_logprob(model, [bos], list(short.encode()), "soft")
    sample = next(s for s in out["samples"]["fb_ppl"] if s["doc_id"] == 0)
    assert sample["resps"][0][0] == pytest.approx(ll, abs=1e-4)

    # Generation: greedy soft decoding of the prompt, cut at the first stop string.
    for doc, sample in zip(GEN_DOCS, sorted(out["samples"]["fb_gen"], key=lambda s: s["doc_id"])):
        ids = [bos] + list(doc["prompt"].encode())
        tokens = generate(model, [ids], 12, mode="soft", eos_token_id=257)[0].tolist()
        text = bytes(t for t in tokens[: tokens.index(257)] if t < 256) if 257 in tokens else bytes(
            t for t in tokens if t < 256)
        text = text.decode("utf-8", errors="replace")
        for stop in ("\n", "Q:"):
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text


def test_long_document_is_scored_in_windows(byte_model_dir):
    """A document longer than max_length: lm-eval's disjoint windows, each scored with its own context."""
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from fullband.lm_eval import FullbandLM

    root, model, _ = byte_model_dir
    text = PPL_DOCS[1]["text"]
    assert len(text) > 64
    lm = FullbandLM(pretrained=str(root / "model"), decode_mode="standard", device="cpu", max_length=32)
    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    total = lm.loglikelihood_rolling([req])[0]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(list(text.encode()), 256, 32, 1)]
    assert len(windows) > 2
    expected = sum(independent_logprob(model, ctx, tgt, "standard") for ctx, tgt in windows)
    assert total == pytest.approx(expected, abs=1e-3)
    # Longer windows see more context: a different (finite) number.
    wide = FullbandLM(pretrained=str(root / "model"), decode_mode="standard", device="cpu", max_length=64)
    assert math.isfinite(wide.loglikelihood_rolling([req])[0]) and wide.loglikelihood_rolling([req])[0] != total


def test_generate_until_sampling_is_batched_and_seeded(byte_model_dir):
    from lm_eval.api.instance import Instance

    from fullband.lm_eval import FullbandLM

    root, _, _ = byte_model_dir
    lm = FullbandLM(pretrained=str(root / "model"), decode_mode="fused", fused_passes=1, device="cpu", batch_size=3)
    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 0.8}
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p, kwargs), idx=0)
            for p in ("abc", "hello there", "x", "abc")]
    torch.manual_seed(0)
    first = lm.generate_until(reqs)
    torch.manual_seed(0)
    assert lm.generate_until(reqs) == first
    assert all("\n" not in t for t in first)
    greedy = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    same = lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=(p, greedy), idx=0)
                              for p in ("abc", "abc")])
    assert same[0] == same[1]


# --------------------------------------------------------------------------------------------------
# The stock hf model on an export (standard mode) == the fullband model in standard mode


def test_stock_hf_model_on_export_matches_fullband_standard(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fullband.data.tokenizers import HFTokenizer
    from fullband.hf import export_hf

    words = sorted({w for d in MC_DOCS for w in d["question"].split() + d["choices"]})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf_tok.save_pretrained(tmp_path / "hf_tok")
    model = lively_model(vocab_size=len(vocab))
    model.save_pretrained(tmp_path / "model")
    HFTokenizer(tmp_path / "hf_tok").save(tmp_path / "model" / "tokenizer")
    export_hf(tmp_path / "model", tmp_path / "exp")
    tasks = write_tasks(tmp_path)

    ours = run_lm_eval("fullband", f"pretrained={tmp_path / 'model'},decode_mode=standard,device=cpu", tasks,
                       ["fb_mc"])
    stock = run_lm_eval("hf", f"pretrained={tmp_path / 'exp'},trust_remote_code=True,add_bos_token=True,"
                        "dtype=float32,device=cpu", tasks, ["fb_mc"])
    lls = {name: [r[0][0] for s in sorted(out["samples"]["fb_mc"], key=lambda s: s["doc_id"]) for r in s["resps"]]
           for name, out in (("ours", ours), ("stock", stock))}
    assert lls["ours"] == pytest.approx(lls["stock"], abs=1e-5)
    assert ours["results"]["fb_mc"]["acc,none"] == stock["results"]["fb_mc"]["acc,none"]


def test_export_directory_loads_into_the_fullband_model(byte_model_dir, tmp_path):
    from lm_eval.api.instance import Instance

    from fullband.hf import export_hf
    from fullband.lm_eval import FullbandLM

    root, _, _ = byte_model_dir
    export_hf(root / "model", tmp_path / "exp")
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)
            for ctx, cont in (("the cat", " sat"), ("blue", " sky and sea"))]
    for mode in ("soft", "fused"):
        ours = FullbandLM(pretrained=str(root / "model"), decode_mode=mode, device="cpu").loglikelihood(reqs)
        exported = FullbandLM(pretrained=str(tmp_path / "exp"), decode_mode=mode, device="cpu").loglikelihood(reqs)
        assert exported == ours


# --------------------------------------------------------------------------------------------------
# Errors


def test_bad_model_args_and_checkpoints(byte_model_dir, tmp_path):
    from fullband.lm_eval import FullbandLM

    root, _, _ = byte_model_dir
    path = str(root / "model")
    with pytest.raises(ValueError, match="unknown decode_mode 'loud'; choose one of standard, soft, fused"):
        FullbandLM(pretrained=path, decode_mode="loud")
    with pytest.raises(ValueError, match="scoring='fast'"):
        FullbandLM(pretrained=path, scoring="fast")
    with pytest.raises(ValueError, match="fused_passes must be an integer >= 1, 'auto' or 'exact', got 'many'"):
        FullbandLM(pretrained=path, fused_passes="many")
    with pytest.raises(ValueError, match="batch_size='auto' must be a positive integer"):
        FullbandLM(pretrained=path, batch_size="auto")
    with pytest.raises(ValueError, match=r"max_length=100 must be in \[2, max_seq_len=64\]"):
        FullbandLM(pretrained=path, max_length=100)
    (tmp_path / "junk").mkdir()
    with pytest.raises(Exception, match="model directory"):
        FullbandLM(pretrained=str(tmp_path / "junk"))
    lm = FullbandLM(pretrained=path, device="cpu", max_length=8)
    with pytest.raises(ValueError, match="does not fit max_length=8"):
        lm._score([([256, 1], [2] * 12)])


def test_dtype_is_as_stored_unless_asked(byte_model_dir, tmp_path):
    """One dtype rule at every door: the weights' stored dtype unless dtype= asks for another."""
    from fullband.data.tokenizers import ByteTokenizer
    from fullband.lm_eval import FullbandLM

    root, model, _ = byte_model_dir
    copy.deepcopy(model).to(torch.float64).save_pretrained(tmp_path / "f64")
    ByteTokenizer().save(tmp_path / "f64" / "tokenizer")
    assert FullbandLM(pretrained=str(tmp_path / "f64"), device="cpu").model.embed.weight.dtype == torch.float64
    asked = FullbandLM(pretrained=str(tmp_path / "f64"), device="cpu", dtype="float32")
    assert asked.model.embed.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype='float8' is not one of float32, bfloat16, float16, float64"):
        FullbandLM(pretrained=str(root / "model"), dtype="float8")


def test_cli_runs_lm_eval_and_reports_bad_tasks(byte_model_dir, tmp_path, capsys, monkeypatch):
    import lm_eval.tasks

    from fullband.cli import main

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        """Skip indexing lm-eval's thousands of built-in tasks (~30 s); this test is about the passthrough."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasksOnly)
    root, _, tasks = byte_model_dir
    args = ["lm-eval", "--model", "fullband", "--model_args", f"pretrained={root / 'model'},decode_mode=fused",
            "--device", "cpu", "--batch_size", "2", "--include_path", tasks, "--output_path", str(tmp_path / "out")]
    assert main([*args, "--tasks", "fb_mc"]) == 0
    assert "fb_mc" in capsys.readouterr().out
    code = main([*args, "--tasks", "no_such_task_xyz"])
    err = capsys.readouterr().err
    assert code == 2 and "no_such_task_xyz" in err and "Traceback" not in err, err


def test_cli_names_the_extra_when_lm_eval_is_missing(monkeypatch, capsys):
    import sys

    from fullband.cli import main

    monkeypatch.setitem(sys.modules, "fullband.lm_eval", None)  # as if lm-eval were not installed
    assert main(["lm-eval", "--tasks", "x"]) == 2
    assert "pip install 'fullband[eval]'" in capsys.readouterr().err
