"""bench/README.md stays a results page: short, every command it names runs a script that
exists, every bench script has its place on it, and its contents links land on headings."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
README = BENCH / "README.md"


def test_at_most_250_lines() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_every_command_names_an_existing_script() -> None:
    text = README.read_text(encoding="utf-8")
    named = re.findall(r"python (?:-X \S+ )?-m\s+bench\.([a-z_]+)\b", text)  # not `bench.NAME`
    named += re.findall(r"python bench/([a-z_]+)\.py", text)
    assert named, "the page names no command"
    missing = sorted({name for name in named if not (BENCH / f"{name}.py").is_file()})
    assert not missing, f"commands for scripts that do not exist: {missing}"


def test_every_script_is_on_the_page() -> None:
    text = README.read_text(encoding="utf-8")
    absent = sorted(path.name for path in BENCH.glob("*.py") if path.name not in text)
    assert not absent, f"bench scripts the page does not mention: {absent}"


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_contents_links_land_on_headings() -> None:
    text = README.read_text(encoding="utf-8")
    anchors = {github_anchor(h) for h in re.findall(r"^#{2,3} (.+)$", text, re.MULTILINE)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and not sorted(set(links) - anchors)
