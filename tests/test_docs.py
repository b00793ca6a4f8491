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
    lines = text[text.index(header) :].splitlines()
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
    one = _table(
        demo,
        "| method | final reward (last 20 steps) | lowest 20-step reward | collapsed | masked fraction "
        "| blocked updates with mu < 0.2 | held-out",
    )
    three = _table(
        demo,
        "| method | final reward (last 20 steps) | lowest 20-step reward | collapsed | masked "
        "fraction | blocked updates with mu < 0.2 (pooled)",
    )
    final = {method: float(cells[0].split()[0]) for method, cells in one.items()}
    held_out = {method: cells[5].split("->")[1].strip() for method, cells in one.items()}
    held_out_3 = {method: cells[6].split()[0] for method, cells in three.items()}
    for column in (final, held_out, held_out_3):
        assert max(column, key=lambda method: float(column[method])) == "grpo_clip_higher", column
    caption = " ".join((ROOT / "README.md").read_text().split("![the paper's point", 1)[1].split("\n\n")[1].split())
    start = one["grpo_clip_higher"][5].split("->")[0].strip()
    assert (
        f"GRPO Clip-Higher: it had the best final reward ({final['grpo_clip_higher']:.2f}) and held-out accuracy "
        f"({start} -> {held_out['grpo_clip_higher']}) of the seven methods in this run, and the best held-out "
        f"accuracy over three seeds ({held_out_3['grpo_clip_higher']})"
    ) in caption, caption
    assert len(one) == 7


MEASURED = re.compile(
    r"\b(?:H100|H200|A100|Xeon|EPYC)\b"  # a machine
    r"|(?<![\w.])~?\d(?:[\d,]*\d)?(?:\.\d+)?(?:-\d(?:[\d,]*\d)?(?:\.\d+)?)?(?:\s?(?:ms|us|seconds|minutes|min)| s)\b"  # a time
    r"|(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b"  # a ratio
)
NOT_MEASURED = {
    # (file, figure): settings and quoted upstream constants, not figures measured here
    ("verl_dppo/rehearsal/patches/vllm_shm_broadcast.py", "50 ms"),
    ("verl_dppo/rehearsal/patches/vllm_shm_broadcast.py", "1 s"),
    ("verl_dppo/rehearsal/patches/__init__.py", "50 ms"),
    ("verl_dppo/rehearsal/patches/__init__.py", "1 s"),
    ("bench/vllm_spin.py", "50 ms"),
    ("bench/vllm_spin.py", "1 s"),
    ("bench/gpu_suite.py", "600 s"),  # the device call's limit
}
GOAL = re.compile(r"(?:goal|target|<=|>=|at most|at least|ideally)[^.;]{0,40}$")


def docstrings(path: Path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "name", "<module>"), doc
        if isinstance(node, (ast.Module, ast.ClassDef)):  # an attribute's docstring: the string after its assignment
            for first, second in zip(node.body, node.body[1:]):
                if (
                    isinstance(first, (ast.Assign, ast.AnnAssign))
                    and isinstance(second, ast.Expr)
                    and isinstance(second.value, ast.Constant)
                    and isinstance(second.value.value, str)
                ):
                    yield "an attribute", second.value.value


def measured_figures(path: Path, relative: str) -> list[str]:
    found = []
    for name, doc in docstrings(path):
        for match in MEASURED.finditer(doc):
            figure = match.group(0)
            if (relative, figure) in NOT_MEASURED or GOAL.search(doc[max(0, match.start() - 60) : match.start()]):
                continue
            if figure.endswith("x") and re.search(r"\s[x*]\s", doc[match.start() : match.end() + 3]):
                continue
            found.append(
                f"{relative} ({name}): {figure!r} in ...{doc[max(0, match.start() - 40) : match.end() + 20]!r}"
            )
    return found


def test_no_docstring_carries_a_measured_figure():
    """Issue 74: docstrings say what and why; a time, a speed-up or the machine it was measured on lives in
    docs/benchmarks.md with its command, machine and date, where it is re-measured (a docstring's copy goes stale)."""
    found = []
    for root in ("verl_dppo", "patches", "bench"):
        for path in sorted((ROOT / root).rglob("*.py")):
            found += measured_figures(path, str(path.relative_to(ROOT)))
    assert not found, "measured figures in docstrings (move them to docs/benchmarks.md):\n" + "\n".join(found)


def test_the_measured_figure_check_finds_one(tmp_path):
    """The check itself: a docstring that quotes a timing, a ratio and a machine is caught; a goal and a setting are
    not."""
    path = tmp_path / "module.py"
    path.write_text('"""The step took 2.2 ms on an H100, 1.4x faster.\n\nGoal: at most 1.05x. A size of 16 x 64."""\n')
    found = measured_figures(path, "module.py")
    assert [line.split(": ", 1)[1].split(" in ")[0] for line in found] == ["'2.2 ms'", "'H100'", "'1.4x'"]
