"""`read_json_file`: one error line naming the option, for every way a named file is bad."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtally.errors import InputError
from streamtally.json_input import read_json_file


def test_a_json_file_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_text('{"keys": [1, 2]}', encoding="utf-8")
    assert read_json_file("--x map.json", path) == {"keys": [1, 2]}


def test_a_missing_file_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^--api-keys k\.json: cannot read it \(No such file"):
        read_json_file("--api-keys k.json", tmp_path / "absent.json")


def test_a_directory_is_not_readable(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^--provider-map d: cannot read it \("):
        read_json_file("--provider-map d", tmp_path)


def test_text_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{keys: 1}", encoding="utf-8")
    with pytest.raises(InputError, match=r"^--provider-map bad\.json: not JSON \(Expecting"):
        read_json_file("--provider-map bad.json", path)


def test_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"tenant": "caf\xe9"}')
    with pytest.raises(InputError, match=r"^--api-keys latin\.json: not UTF-8 text \(invalid"):
        read_json_file("--api-keys latin.json", path)
