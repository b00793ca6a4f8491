"""The README and the docs pages (issue 27.1): the README stays short, and every relative link in them, with its
#anchor, leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_LINES = 250


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(page: Path) -> list[str]:
    text, in_code, out = page.read_text().splitlines(), False, []
    for line in text:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            out.extend(LINK.findall(line))
    return [link for link in out if not link.startswith(("http://", "https://", "mailto:"))]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for link in links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slug_is_githubs():
    assert slug("Run a recipe on CPU: `cpu_tiny`") == "run-a-recipe-on-cpu-cpu_tiny"
    assert slug("What this adds over verl's built-ins") == "what-this-adds-over-verls-built-ins"


def _table(text: str, header: str) -> dict[str, list[str]]:
    """The markdown table whose header row starts with `header`: method -> its cells."""
    lines = text[text.index(header):].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_readme_caption_says_which_method_learned_best_as_the_demo_page_does():
    """Issue 43.6: the headline figure shows the blocked updates; its caption says, with docs/demo.md's numbers, that
    GRPO Clip-Higher had the best final reward and held-out accuracy of the seed-0 run and the best held-out accuracy
    over three seeds, so that a reader of the README alone is not misled."""
    demo = (ROOT / "docs" / "demo.md").read_text()
    one = _table(demo, "| method | final reward (last 20 steps) | lowest 20-step reward | collapsed | masked fraction "
                       "| blocked updates with mu < 0.2 | held-out")
    three = _table(demo, "| method | final reward (last 20 steps) | lowest 20-step reward | collapsed | masked "
                         "fraction | blocked updates with mu < 0.2 (pooled)")
    final = {method: float(cells[0].split()[0]) for method, cells in one.items()}
    held_out = {method: cells[5].split("->")[1].strip() for method, cells in one.items()}
    held_out_3 = {method: cells[6].split()[0] for method, cells in three.items()}
    for column in (final, held_out, held_out_3):
        assert max(column, key=lambda method: float(column[method])) == "grpo_clip_higher", column
    caption = " ".join((ROOT / "README.md").read_text().split("![the paper's point", 1)[1].split("\n\n")[1].split())
    start = one["grpo_clip_higher"][5].split("->")[0].strip()
    assert (f"GRPO Clip-Higher: it had the best final reward ({final['grpo_clip_higher']:.2f}) and held-out accuracy "
            f"({start} -> {held_out['grpo_clip_higher']}) of the seven methods in this run, and the best held-out "
            f"accuracy over three seeds ({held_out_3['grpo_clip_higher']})") in caption, caption
    assert len(one) == 7
