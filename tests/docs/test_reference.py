"""The generated reference pages match the code, and every repository link in the docs points
at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvgate.reference import PAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rel", sorted(PAGES))
def test_generated_page_is_up_to_date(rel: str) -> None:
    expected = PAGES[rel]()
    actual = (ROOT / rel).read_text()
    assert actual == expected, f"{rel} is out of date: run `python -m kvgate.reference`"


def test_every_field_of_the_model_is_documented() -> None:
    from kvgate.config import Config

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in Config.model_fields:
        assert f"| `{name}` |" in page


LINK = re.compile(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)")


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
)
def test_links_point_at_files_in_the_repository(doc: str) -> None:
    base = (ROOT / doc).parent
    missing = [
        target for target in LINK.findall((ROOT / doc).read_text()) if not (base / target).exists()
    ]
    assert not missing, f"{doc} links to missing files: {missing}"
