"""The main job, in its quick form: both runs, the table, samples in every mode, the plot."""

import json

from fullband.demo import RUNS, run_demo


def test_quick_demo_end_to_end(tmp_path, capsys):
    summary = run_demo(tmp_path, quick=True)
    printed = capsys.readouterr().out
    assert "| baseline |" in printed and "| fbt |" in printed
    assert set(summary["eval"]) == set(RUNS)
    for result in summary["eval"].values():
        assert set(result["loss"]) == {"standard", "fused(1)", "fused(2)", "fused(3)", "sequential"}
    # Same token budget; the FBT's token-equivalent compute is larger once K > 1 steps happen.
    assert summary["compute_tokens"]["fbt"] > summary["compute_tokens"]["baseline"]
    assert len(summary["samples"]) == 6 and all(s.startswith("import os") for s in summary["samples"].values())
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["token_budget"] == summary["token_budget"]
    # The state-tracking part: both models graded at 1× and 8× the training length, table and plot.
    runs = summary["state_tracking"]["runs"]
    assert set(runs["fbt"]["accuracy"]["8"]) == {"exact", "plain"}
    assert set(runs["baseline"]["accuracy"]["8"]) == {"plain"}
    assert "| FBT, exact recurrence over the prompt |" in printed
    assert (tmp_path / "state_tracking.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
