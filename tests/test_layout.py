"""Issue 11: the tree shows the architecture. Layers, imported downward only:

    verl_dppo.cli  ->  verl_dppo.cpu (the CPU rehearsal)  ->  verl_dppo.plugin / verl_dppo.patches  ->  verl_dppo.math

(`verl_dppo.cpu` is what exists for a run on this machine's CPUs only: the CPU platform, the `hf` rollout, the Ray
object-store checkpoint engine, Megatron's CPU shim; the plugin's entry and the CPU-only patches load it on demand.)

checked on the import graph read from the source (every import, module-level or inside a function), a fresh
interpreter that imports every module dependents-first (what would expose a cycle), a wheel built from the
checkout that loads the plugin with `patches/` inside it, and a package root that holds nothing outside the layers.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"verl_dppo": REPO / "verl_dppo", "verl_dppo.patches": REPO / "patches"}


def modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(every verl_dppo module it imports, those imported at module level), resolved to module names."""
    known = modules()
    every, top = set(), set()
    tree = ast.parse(path.read_text())
    top_nodes = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("verl_dppo"):
                every.add(target)
                if id(node) in top_nodes:
                    top.add(target)
    return every, top


def layer(module: str) -> str:
    for prefix in ("verl_dppo.math", "verl_dppo.plugin", "verl_dppo.patches", "verl_dppo.cpu", "verl_dppo.cli"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.rpartition(".")[2]
    return "root"


ALLOWED = {  # layer -> layers it may import
    "math": {"math"},
    "plugin": {"plugin", "math"},
    "patches": {"patches", "plugin", "math", "cpu"},  # the CPU-only patches read the CPU platform's state
    "cpu": {"cpu", "patches", "plugin", "math"},
    "cli": {"cli", "cpu", "patches", "plugin", "math", "root"},
    "root": {"plugin"},  # verl_dppo/__init__: DPPOLossConfig, lazily
}


def test_every_module_imports_only_downward():
    wrong = []
    for name, path in modules().items():
        every, _ = imports_of(name, path)
        for target in every:
            allowed = ALLOWED[layer(name)] | ({"patches", "cpu"} if name == "verl_dppo.plugin.entry" else set())
            if layer(target) not in allowed:
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def test_the_math_layer_imports_nothing_but_torch_triton_and_the_standard_library():
    """Triton only where the GPU kernels live (`verl_dppo.math.kernels`), and there only inside a function: the
    package imports without it (CPU machines, the suite's own processes)."""
    for name, path in modules().items():
        if layer(name) != "math":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            roots = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else (
                [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module else [])
            for root in roots:
                if root == "triton" and name == "verl_dppo.math.kernels":
                    continue
                assert root in sys.stdlib_module_names or root in ("torch", "verl_dppo", "__future__"), (name, root)
    top_level = ast.parse(modules()["verl_dppo.math.kernels"].read_text()).body
    assert not any(isinstance(node, (ast.Import, ast.ImportFrom)) and "triton" in ast.unparse(node)
                   for node in top_level), "verl_dppo.math.kernels imports Triton at module level"


def test_no_module_is_over_about_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 420}
    assert not long, long


def _order_dependents_first() -> list[str]:
    graph = {name: imports_of(name, path)[1] for name, path in modules().items()}
    order, state = [], {}

    def visit(node, stack):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import cycle: {' -> '.join(stack + [node])}"
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            visit(child, stack + [node])
        state[node] = "done"
        order.append(node)

    for node in sorted(graph):
        visit(node, [])
    return order[::-1]  # a module before everything it imports: a cycle would meet a half-initialised module


def test_no_import_cycles_in_a_fresh_interpreter():
    order = [name for name in _order_dependents_first() if name != "verl_dppo.cli.__main__"]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_the_package_root_holds_only_the_layers():
    """The pre-0.2 shims (verl_dppo.adapter, .topk, .divergence, .trust_region) never shipped to users: gone, so
    every module sits in one of the layers the import check above knows."""
    root = REPO / "verl_dppo"
    extra = sorted(p.name for p in root.iterdir()
                   if p.name not in {"__init__.py", "math", "plugin", "cpu", "cli", "__pycache__"})
    assert not extra, extra
    assert {layer(name) for name in modules()} == {"math", "plugin", "patches", "cpu", "cli", "root"}
    assert [name for name in modules() if layer(name) == "root"] == ["verl_dppo"]


def test_a_wheel_from_the_checkout_loads_the_plugin_with_its_patches(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("verl_dppo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "patches").glob("*.py"):
        assert f"verl_dppo/patches/{path.name}" in names
    assert "verl_dppo/recipes/setup/moe_base.yaml" in names
    for path in (REPO / "recipes").rglob("*.yaml"):  # every recipe file, the trainer modes included
        assert f"verl_dppo/recipes/{path.relative_to(REPO / 'recipes').as_posix()}" in names, path
    assert not any(name.startswith("tests/") or "vllm_fixtures" in name for name in names)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import verl, verl_dppo.patches as p, verl_dppo.plugin.entry as e\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(p.__file__); print(sorted(k for k in R if getattr(R[k], '__verl_dppo__', False)))\n"
        "import verl.workers.utils.losses as L; print(getattr(L.ppo_loss, '__verl_dppo_wrapped__', False))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(target)), lines
    assert "dppo_binary_tv" in lines[1] and "dppo_topk_kl" in lines[1] and lines[2] == "True"


def test_the_package_declares_its_license_and_ships_the_text():
    """Issue 32.1: Apache-2.0 (verl's own license), declared in the installed package's metadata and shipped whole."""
    import importlib.metadata
    from pathlib import Path

    metadata = importlib.metadata.metadata("verl-dppo")
    assert "Apache-2.0" in (metadata.get("License-Expression"), metadata.get("License"))
    assert "LICENSE" in (metadata.get_all("License-File") or [])
    text = (Path(__file__).resolve().parent.parent / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
