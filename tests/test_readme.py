"""The README's Python example must run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_api_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    for mode in ("standard", "soft", "fused"):
        assert f"\n{mode} [[" in printed
    assert printed.count("step:") == 3
