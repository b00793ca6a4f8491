"""Issues 11 and 42: the tree shows the architecture. Layers, imported downward only:

    verl_dppo.cli  ->  verl_dppo.studies  ->  verl_dppo.launch  ->  verl_dppo.rehearsal (the CPU rehearsal)
        ->  verl_dppo.plugin / verl_dppo.patches (what a cluster process loads)  ->  verl_dppo.math

with two leaf modules, `verl_dppo.errors` and `verl_dppo.datasets`, that the layers above the plugin share.
`verl_dppo.rehearsal` is what exists for a run on CPUs only (the CPU platform, the `hf` rollout, the Ray
object-store checkpoint engine, Megatron's CPU shim, the CPU-only patches, the CPU setups' builds); it registers
from an entry point of its own, so nothing a cluster process loads imports it.

Checked on the import graph read from the source (every import, module-level or inside a function: no edge up the
layers, no cycle among modules), a fresh interpreter that imports every module dependents-first (what would expose a
cycle at import time), a fresh `import verl` that loads the plugin alone (no module of the rehearsal appears) and
both entry points, folders that each hold one concern and at most about 3k lines, a wheel built from the checkout
that loads the plugin with `patches/` inside it, and a package root that holds nothing outside the layers.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path


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


LAYERS = ("math", "plugin", "patches", "errors", "datasets", "rehearsal", "launch", "studies", "cli")


def layer(module: str) -> str:
    for name in LAYERS:
        prefix = f"verl_dppo.{name}"
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "root"


CLUSTER = {"plugin", "patches", "math"}
"""What a cluster process loads (`verl_dppo.plugin.entry`, the `dppo` entry point)."""
ALLOWED = {  # layer -> layers it may import
    "math": {"math"},
    "plugin": {"plugin", "math"},
    "patches": CLUSTER,
    "errors": set(),
    "datasets": {"errors"},
    "rehearsal": CLUSTER | {"rehearsal", "errors", "datasets"},
    "launch": CLUSTER | {"launch", "rehearsal", "errors", "datasets"},
    "studies": CLUSTER | {"studies", "launch", "rehearsal", "errors", "datasets"},
    "cli": {"cli", "errors"},  # the commands themselves by name only (COMMAND_MODULES), so `--help` stays instant
    "root": {"plugin"},  # verl_dppo/__init__: DPPOLossConfig, lazily
}


def test_every_module_imports_only_downward():
    wrong = []
    for name, path in modules().items():
        every, _ = imports_of(name, path)
        for target in every:
            allowed = ALLOWED[layer(name)] | ({"patches"} if name == "verl_dppo.plugin.entry" else set())
            if layer(target) not in allowed:
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as a path [a, b, ..., a], or [] when there is none."""
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> list[str]:
        if state.get(node) == "open":
            return stack[stack.index(node) :] + [node]
        if state.get(node) == "done":
            return []
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            found = visit(child, stack + [node])
            if found:
                return found
        state[node] = "done"
        return []

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_cycle_among_modules_counting_every_import():
    """Imports inside functions included, which the fresh-interpreter check below (module-level imports) cannot
    see: `doctor` imported `ray_probe` and `ray_probe`'s worker entry imported `doctor` back (issue 19)."""
    graph = {name: imports_of(name, path)[0] for name, path in modules().items()}
    assert not _cycle(graph), " -> ".join(_cycle(graph))
    assert "verl_dppo.launch.install_probe" in graph["verl_dppo.launch.ray_probe"]  # the worker's probe, not doctor's


def test_each_folder_holds_one_concern_and_at_most_about_3k_lines():
    """The package root holds the layers and the two leaf modules; each folder's own modules (not its sub-folders)
    stay at or under 3,200 lines, and every module sits in exactly one layer."""
    folders: dict[Path, int] = {}
    for name, path in modules().items():
        folders[path.parent] = folders.get(path.parent, 0) + len(path.read_text().splitlines())
    assert max(folders.values()) <= 3200, {str(k.relative_to(REPO)): v for k, v in folders.items() if v > 3200}
    assert len(folders) >= 10, folders  # the layers, and their sub-folders (demo, hf_rollout, setups, patches)


def test_a_cluster_process_loads_the_plugin_without_the_rehearsal():
    """The `dppo` entry alone (VERL_USE_EXTERNAL_PLUGINS=dppo, as a cluster may pin it): the loss modes and the
    patches are in, and no module of the CPU rehearsal, the launcher, the studies or the command line was imported.
    With every entry point (the default), the rehearsal registers the hf rollout and the CPU platform."""
    code = (
        "import sys, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "import verl.workers.rollout.replica as replica\n"
        "print(sorted(k for k in R if getattr(R[k], '__verl_dppo__', False)))\n"
        "print('hf' in replica.RolloutReplicaRegistry._registry)\n"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('verl_dppo.')}))\n"
    )
    seen = {}
    for policy in ("dppo", "auto"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
        env["VERL_USE_EXTERNAL_PLUGINS"] = policy
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        seen[policy] = result.stdout.splitlines()
    modes, hf, packages = seen["dppo"]
    assert "dppo_binary_tv" in modes and "troll" in modes
    assert hf == "False" and set(eval(packages)) <= CLUSTER, packages
    modes, hf, packages = seen["auto"]
    assert "dppo_binary_tv" in modes and hf == "True" and "rehearsal" in eval(packages), packages
    from importlib.metadata import entry_points

    assert {(e.name, e.value) for e in entry_points(group="verl.plugins")} >= {
        ("dppo", "verl_dppo.plugin.entry"),
        ("dppo_cpu", "verl_dppo.rehearsal.entry"),
    }


KERNEL_MODULES = ("verl_dppo.math.kernels", "verl_dppo.math.kernels.jit")


def test_the_math_layer_imports_nothing_but_torch_triton_and_the_standard_library():
    """Triton only where the GPU kernels live (their source, `verl_dppo.math.kernels.jit`, and the dispatch that asks
    whether Triton imports, `verl_dppo.math.kernels`), and there only inside a function: the package imports without
    it (CPU machines, the suite's own processes)."""
    for name, path in modules().items():
        if layer(name) != "math":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            roots = (
                [a.name.split(".")[0] for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            for root in roots:
                if root == "triton" and name in KERNEL_MODULES:
                    continue
                assert root in sys.stdlib_module_names or root in ("torch", "verl_dppo", "__future__"), (name, root)
    for name in KERNEL_MODULES:
        top_level = ast.parse(modules()[name].read_text()).body
        assert not any(
            isinstance(node, (ast.Import, ast.ImportFrom)) and "triton" in ast.unparse(node) for node in top_level
        ), f"{name} imports Triton at module level"


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
    extra = sorted(
        p.name
        for p in root.iterdir()
        if p.name
        not in {
            "__init__.py",
            "errors.py",
            "datasets.py",
            "math",
            "plugin",
            "rehearsal",
            "launch",
            "studies",
            "cli",
            "__pycache__",
        }
    )
    assert not extra, extra
    assert {layer(name) for name in modules()} == {*LAYERS, "root"}
    assert [name for name in modules() if layer(name) == "root"] == ["verl_dppo"]


def test_a_wheel_from_the_checkout_loads_the_plugin_with_its_patches(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("verl_dppo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "patches").glob("*.py"):
        assert f"verl_dppo/patches/{path.name}" in names
    assert "verl_dppo/rehearsal/patches/vllm_cpu_moe.py" in names
    assert "verl_dppo/rehearsal/isa_site/sitecustomize.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dppo_cpu = verl_dppo.rehearsal.entry" in entry_text
    assert "[vllm.general_plugins]\ndppo_cpu = verl_dppo.rehearsal.patches.vllm_shm_broadcast:register" in entry_text
    assert "verl_dppo/recipes/setup/moe_base.yaml" in names
    for path in (REPO / "recipes").rglob("*.yaml"):  # every recipe file, the trainer modes included
        assert f"verl_dppo/recipes/{path.relative_to(REPO / 'recipes').as_posix()}" in names, path
    assert not any(name.startswith("tests/") or "vllm_fixtures" in name for name in names)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import verl, verl_dppo.patches as p, verl_dppo.plugin.entry as e\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(p.__file__); print(sorted(k for k in R if getattr(R[k], '__verl_dppo__', False)))\n"
        "import verl.workers.utils.losses as L; print(getattr(L.ppo_loss, '__verl_dppo_wrapped__', False))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
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


def _mode_name_comparisons(tree: ast.AST, names: set[str]) -> list[str]:
    """`<...mode...> == "troll"`, `mode in ("dppo_topk_tv", ...)`, `loss_mode.startswith("dppo_")`: a mode's fact
    read off its name, where one side names a mode (an identifier with the word "mode" in it: `loss_mode`)."""

    def about_a_mode(node: ast.AST) -> bool:
        last = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        return "mode" in last.split("_")

    def constants(node: ast.AST) -> set[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)}

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(about_a_mode(side) for side in sides) and set().union(*map(constants, sides)) & names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"startswith", "endswith"}
            and about_a_mode(node.func.value)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_mode_is_asked_about_by_its_name_outside_the_registry():
    """Issue 74: a mode's facts (family, measure, K, its logits hook) are asked of the registry
    (`verl_dppo.plugin.modes`), not read off its name; only the registry, the modes' own modules and the command
    line's parsing compare a mode with a name. The check finds such a comparison where one is written."""
    from verl_dppo.plugin.modes import loss_modes

    names = {mode.name for mode in loss_modes()}
    planted = ast.parse('if method.loss_mode == "troll" or loss_mode.endswith("_kl"):\n    pass\n')
    assert len(_mode_name_comparisons(planted, names)) == 2
    allowed = {"verl_dppo.plugin.modes", "verl_dppo.cli"}
    found = {}
    for name, path in modules().items():
        if name in allowed or name.startswith("verl_dppo.cli.") or name.endswith("_mode"):
            continue
        if hits := _mode_name_comparisons(ast.parse(path.read_text()), names):
            found[name] = hits
    assert not found, found


def test_the_walk_of_a_plain_loss_call_enters_no_module_of_a_feature_that_is_off(tmp_path, monkeypatch):
    """Issue 74: a reader follows `dppo_binary_tv` from the config to the masked loss (`bench/loss_walk.py`'s walk of
    one `ppo_loss` call) without R3's module or `verl-dppo mismatch`'s dump, which a plain run leaves off, and without
    the import hook (the `ppo_loss` wrapper imports what it calls when it is installed). With both on, the same walk
    enters them: the assertion can fail."""
    import importlib.util

    from verl_dppo.plugin import mismatch_dump
    from verl_dppo.plugin.moe import router_replay

    spec = importlib.util.spec_from_file_location("loss_walk", REPO / "bench" / "loss_walk.py")
    loss_walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_walk)
    off = {"router_replay.py", "mismatch_dump.py", "_import_hook.py"}
    monkeypatch.delenv(mismatch_dump.ENV, raising=False)  # as a plain run has them (another test may have armed R3)
    armed, router_replay.ARMED[0] = router_replay.ARMED[0], False
    try:
        plain = {Path(name).name for name in loss_walk.walk("dppo_binary_tv", 0.15)}
    finally:
        router_replay.ARMED[0] = armed
    assert {"losses.py", "binary_mode.py", "trust_region.py"} <= plain, sorted(plain)
    assert not plain & off, sorted(plain & off)

    monkeypatch.setenv(mismatch_dump.ENV, str(tmp_path))
    router_replay.ARMED[0] = True
    try:
        both_on = {Path(name).name for name in loss_walk.walk("dppo_binary_tv", 0.15)}
    finally:
        router_replay.ARMED[0] = False
    assert {"router_replay.py", "mismatch_dump.py"} <= both_on, sorted(both_on)
    assert list(tmp_path.glob("tokens-*.pt"))


def test_the_walks_function_lines_count_a_nested_function_once():
    """`bench/loss_walk.py`'s second column: each function that ran from its `def` to its last line, a function
    nested in another that ran counted once, one that did not run not at all."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("loss_walk", REPO / "bench" / "loss_walk.py")
    loss_walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_walk)
    source = "def outer():\n    def inner():\n        return 1\n\n    return inner\n\n\ndef other():\n    x = 1\n    return x\n"
    module = compile(source, "<walk>", "exec")
    outer, other = (const for const in module.co_consts if hasattr(const, "co_lines"))
    inner = next(const for const in outer.co_consts if hasattr(const, "co_lines"))
    assert loss_walk.function_lines([outer]) == 5
    assert loss_walk.function_lines([outer, inner]) == 5
    assert loss_walk.function_lines([inner]) == 2
    assert loss_walk.function_lines([outer, other]) == 8
