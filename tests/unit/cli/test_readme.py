"""The README and docs/ are the code's real output: the README maps every command, the docs'
examples run, every setting has its row, and every relative link lands on a file and a heading."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from streamtally.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "README.md").read_text()
#: README.md and every page of docs/, by path relative to the repository.
PAGES = {
    path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
}
#: The page that owns the settings table.
SETTINGS_PAGE = "docs/reference.md"


def _fold_examples() -> list[tuple[list[str], str]]:
    examples = []
    for text in PAGES.values():
        lines = text.splitlines()
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
    assert f"| `streamtally {command}" in README  # a row of the README's commands table
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert command in capsys.readouterr().out


def test_the_readmes_commands_table_names_only_commands_that_exist() -> None:
    table = README.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `streamtally ([a-z]+)", table, re.MULTILINE)
    assert rows  # the table was found
    assert sorted(set(rows) - set(COMMANDS)) == []
    assert sorted(set(COMMANDS) - set(rows)) == []


def test_every_setting_is_documented() -> None:
    from streamtally.settings import VARIABLES

    missing = [name for name in VARIABLES if name not in PAGES[SETTINGS_PAGE]]
    assert missing == []


# --------------------------------------------------------------------------- links


def anchor_of(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation dropped, spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor on a page (a repeated heading's with -1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)#*$", _without_fences(text), re.MULTILINE):
        anchor = anchor_of(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def _without_fences(text: str) -> str:
    """The page without its fenced blocks, where nothing is a heading or a link."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)


def _without_code(text: str) -> str:
    """The page without fenced blocks and inline code, where nothing is a link."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def relative_links(text: str) -> list[str]:
    """The targets of a page's inline links that stay in the repository."""
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _without_code(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: str) -> list[str]:
    """What is wrong with each relative link of a page (none: every link lands)."""
    broken = []
    for target in relative_links(PAGES[page]):
        file, _, anchor = target.partition("#")
        path = ((REPO / page).parent / file).resolve()
        if file and not path.exists():
            broken.append(f"{target}: no file {os.path.relpath(path, REPO)}")
        elif anchor and anchor not in anchors(
            path.read_text(encoding="utf-8") if file else PAGES[page]
        ):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_relative_link_lands_on_a_file_and_a_heading(page: str) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = "docs/example.md"
    text = (
        "# Example\n\n## A heading: with `code`\n\n"
        "[ok](#a-heading-with-code) [ok](pipeline.md#guarantees) [ok](../README.md#commands)\n"
        "[bad](#nowhere) [bad](pipeline.md#nowhere) [bad](no-such-page.md) [web](https://x.org/#y)\n"
        "`[code](not-a-link.md)`\n"
    )
    monkeypatch.setitem(PAGES, page, text)
    assert broken_links(page) == [
        "#nowhere: no heading #nowhere",
        "pipeline.md#nowhere: no heading #nowhere",
        "no-such-page.md: no file docs/no-such-page.md",
    ]


def test_the_docs_link_every_page_of_docs_from_the_readme() -> None:
    linked = {t.partition("#")[0] for t in relative_links(README)}
    pages = {page for page in PAGES if page.startswith("docs/")}
    assert pages - linked == set()
