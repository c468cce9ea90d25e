"""benchmarks/trace_positions.py: per-row trace comparison, and --quick end to end."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trace_positions.py"
spec = importlib.util.spec_from_file_location("trace_positions", SCRIPT)
tp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tp)


def test_written_states_and_row_comparison():
    assert tp.written_states(" 1 0 4 => 4\n => 0") == ["1", "0", "4"]
    assert tp.written_states(" 1101\n11", one_char_each=True) == ["1", "1", "0", "1"]
    assert tp.compare_trace(" 1 0 4 => 4", " 1 0 4 => 4") == {"right": 3, "states": 3, "first_wrong": 3,
                                                              "length_right": True}
    # wrong from the second state on, and one state short
    assert tp.compare_trace(" 1 0 4 => 4", " 1 2 => 2") == {"right": 1, "states": 3, "first_wrong": 1,
                                                            "length_right": False}
    # a later state right again still counts as right at its index; the first wrong one is the first
    assert tp.compare_trace(" 1 0 4 => 4", " 2 0 4 4 => 4") == {"right": 2, "states": 3, "first_wrong": 0,
                                                               "length_right": False}


def test_quick_run_writes_json_and_table(tmp_path, capsys, single_thread):
    out = tmp_path / "tp.json"
    records = tp.main(["--quick", "--tasks", "cycle,parity", "--seeds", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == records
    assert [(r["task"], r["moves"]) for r in records] == [("cycle:trace=true", 2), ("cycle:trace=true", 4),
                                                          ("parity:trace=true", 2), ("parity:trace=true", 4)]
    assert all(0 <= r["states_right"] <= 1 and 0 <= r["length_right"] <= 1 for r in records)
    assert "| cycle:trace=true | 0 | 4 |" in capsys.readouterr().out
