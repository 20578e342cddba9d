"""The README's examples are the code's real output, and it documents every command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from streamtally.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "README.md").read_text()


def _fold_examples() -> list[tuple[list[str], str]]:
    lines = README.splitlines()
    examples = []
    for i, line in enumerate(lines):
        if line.startswith("$ streamtally fold "):
            examples.append((shlex.split(line[2:])[1:], lines[i + 1]))
    return examples


EXAMPLES = _fold_examples()


def test_the_readme_has_one_fold_example_per_source() -> None:
    sources = {args[args.index("--source") + 1] for args, _ in EXAMPLES}
    assert sources == {
        "openai",
        "openai-responses",
        "anthropic",
        "gemini",
        "dynamo",
        "vllm",
        "atomr",
    }


@pytest.mark.parametrize(("args", "expected"), EXAMPLES, ids=[a[2] for a, _ in EXAMPLES])
def test_fold_example_prints_what_the_readme_shows(
    args: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    assert main(args) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_documented_and_has_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"streamtally {command}" in README
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert command in capsys.readouterr().out


def test_every_setting_is_documented() -> None:
    from streamtally.settings import VARIABLES

    missing = [name for name in VARIABLES if name not in README]
    assert missing == []
