"""The README's client documentation runs: Python examples against a worker, CLI lines parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from q6serve.client import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(title: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(title), flags=re.DOTALL)


def test_python_examples_run(worker: Any, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    examples = blocks("Python API", "python")
    assert len(examples) >= 2
    monkeypatch.setenv("Q6SERVE_TARGET", worker.target)
    for i, code in enumerate(examples):
        exec(compile(code, f"README.md:python[{i}]", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "b NOT_FOUND" in out and "a (4, 512)" in out and "bfloat16" in out
    assert "rows in the largest coalesced launch" in out
    assert worker.client().list() == []  # the examples clean up after themselves


def test_cli_lines_parse() -> None:
    lines = [ln for b in blocks("Command line", "sh") for ln in b.splitlines()
             if ln.startswith("q6serve ")]
    parser = cli.build_parser()
    assert len(lines) >= 10
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        args = parser.parse_args(argv)  # SystemExit (usage error) fails the test
        assert callable(args.func), line
