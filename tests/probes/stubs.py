"""Stand-ins for engines that do not install on a CPU machine (vLLM, SGLang): every module under the given
package names imports, and each attribute it is asked for is a dummy class. verl's own server modules then import,
unmodified, and their methods run against the stand-in engines the probes provide."""

import importlib.abc
import importlib.machinery
import importlib.metadata as _metadata
import types

FAKE_VERSIONS = {"vllm": "0.24.0", "sglang": "0.5.12"}  # the releases verl 0.9.1's extras pin


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages):
        self.packages = tuple(packages)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = FAKE_VERSIONS.get(spec.name.split(".")[0], "0")
        return module

    def exec_module(self, module):
        pass


def install(*packages: str) -> None:
    """Stub `packages`; verl asks the package metadata for their versions too: answer with the pinned releases."""
    import sys

    sys.meta_path.insert(0, _StubFinder(packages))
    real_version = _metadata.version
    _metadata.version = lambda name: FAKE_VERSIONS[name] if name in packages else real_version(name)


def run_cases(case, argv) -> None:
    """A probe's command line: `ARGS...`, one case, its result printed as JSON (an exception fails the process); or
    `--cases JSON`, a list of cases, each a list of arguments or {"args": [...], "env": {...}} (set for that case
    alone), run one after another in this process (verl imported once), their results printed as one JSON list; a
    case that raises gives {"error": "<type>: <message>"}."""
    import json
    import os
    from unittest import mock

    if argv[:1] != ["--cases"]:
        print(json.dumps(case(*argv)))
        return
    results = []
    for spec in json.loads(argv[1]):
        args, env = (spec["args"], spec.get("env", {})) if isinstance(spec, dict) else (spec, {})
        with mock.patch.dict(os.environ, env):
            try:
                results.append(case(*args))
            except Exception as error:  # noqa: BLE001  (reported to the test, which asserts on it)
                results.append({"error": f"{type(error).__name__}: {error}"})
    print(json.dumps(results))
