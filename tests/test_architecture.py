"""The house's rules, read from the source (docs/architecture.md): no import cycles, no imports of another module's
``_private`` names, library imports at the top of the file, rooms that import only the rooms below them, and a
kernel package that stands alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"qjax": "qjax", "qjax.kernels": "kernels", "qjax.convert": "convert"}

# each room may import the rooms listed here (and itself); anything else is an edge pointing the wrong way
ROOMS = {
    "kernels": set(),
    "xla_env": set(),
    "validation": set(),
    "program_cache": set(),
    "tokenizer": {"validation"},
    "model": {"kernels", "validation"},
    "multimodal": {"model", "validation"},
    "quant": {"model", "kernels", "validation"},
    "checkpoint": {"model", "multimodal", "quant", "kernels", "validation"},
    "convert": {"checkpoint", "model", "quant", "validation"},
    "autoround": {"checkpoint", "convert", "model", "quant", "kernels", "validation", "xla_env", "program_cache",
                  "init"},
    "runtime": {"checkpoint", "convert", "model", "multimodal", "quant", "kernels", "validation"},
    "serving": {"runtime", "model", "multimodal", "tokenizer", "kernels", "validation", "program_cache",
                "xla_env"},
    "evaluation": {"runtime", "checkpoint", "model", "tokenizer", "validation", "init"},
    "builtin": {"evaluation", "runtime", "checkpoint", "model", "tokenizer", "validation"},
    "research": {"model", "kernels"},
    "cli": {"autoround", "builtin", "checkpoint", "convert", "evaluation", "model", "multimodal", "research", "runtime",
            "serving", "tokenizer", "validation", "xla_env", "program_cache", "init"},
    "init": {"xla_env", "multimodal"},  # qjax/__init__.py: its public names are imported on first use
}
# third-party packages that are optional (test extras or a command's own extra): imported where they are used
OPTIONAL = {"torch", "transformers", "lm_eval", "compressed_tensors", "auto_round", "uvicorn",
            "PIL",  # Pillow: a dependency, imported in a try so that a machine without it still loads models
            "matplotlib"}  # the plot extra (qjax compare --plot)


def _modules() -> dict[str, str]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "assets")]
            if pkg == "qjax" and os.path.relpath(dirpath, base).split(os.sep)[0] in ("kernels", "convert"):
                continue
            for f in filenames:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                    mods[pkg if rel == "__init__" else f"{pkg}.{rel}"] = os.path.join(dirpath, f)
    return mods


MODULES = _modules()


def _imports(mod: str) -> list[tuple[str, str | None, bool, int]]:
    """(imported module, imported name or None, at the top of the file, line) for every import in ``mod``."""
    path = MODULES[mod]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    top = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks at the top count as the top
        if isinstance(node, ast.If):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, id(node) in top, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
                parts = base.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = base + (f".{node.module}" if node.module else "")
            else:
                target = node.module
            for a in node.names:
                full = f"{target}.{a.name}"
                out.append((full, None, id(node) in top, node.lineno) if full in MODULES
                           else (target, a.name, id(node) in top, node.lineno))
    return out


def _room(mod: str) -> str:
    if mod == "qjax":
        return "init"
    return mod.split(".")[1]


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_module_is_in_a_room():
    assert set(map(_room, MODULES)) <= set(ROOMS), sorted(set(map(_room, MODULES)) - set(ROOMS))


def test_no_import_cycles():
    graph, seen, stack, cycles = _graph(), {}, [], []

    def visit(m):
        seen[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if seen.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in seen:
                visit(t)
        stack.pop()
        seen[m] = "done"

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(" → ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    bad = [f"{m}:{line} imports {t}.{name}" for m in MODULES for t, name, _, line in _imports(m)
           if name is not None and name.startswith("_") and not name.startswith("__") and t != m]
    assert not bad, "\n".join(bad)


def test_rooms_import_only_the_rooms_below_them():
    bad = [f"{m} ({_room(m)}) → {t} ({_room(t)})" for m, targets in _graph().items() for t in targets
           if _room(t) != _room(m) and _room(t) not in ROOMS[_room(m)]]
    assert not bad, "imports against the direction of docs/architecture.md:\n" + "\n".join(sorted(bad))


def test_library_imports_sit_at_the_top_of_the_file():
    """Inside a function only: optional packages, and the command modules (qjax/cli keeps ``qjax --help`` fast)."""
    bad = []
    for m in MODULES:
        if _room(m) == "cli":
            continue
        for t, _, top, line in _imports(m):
            if not top and t.split(".")[0] not in OPTIONAL and not t.startswith("jax._src"):
                bad.append(f"{m}:{line} imports {t} inside a function")
    assert not bad, "\n".join(bad)


def test_the_kernel_package_stands_alone():
    """kernels/ imports nothing of qjax but itself, and importing it loads neither flax nor the model."""
    bad = [f"{m} → {t}" for m, targets in _graph().items() if m.startswith("qjax.kernels")
           for t in targets if not (t.startswith("qjax.kernels") or t == "qjax")]
    assert not bad, bad
    code = ("import sys, qjax.kernels; "
            "print(sorted(m for m in sys.modules if m == 'flax' or "
            "m.startswith(('flax.', 'qjax.model', 'qjax.checkpoint'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("rule", ["cycle", "private", "direction"])
def test_the_rules_can_fail(rule, monkeypatch):
    """Each rule above finds a planted violation (so a passing run means something)."""
    real = _graph()
    if rule == "cycle":
        planted = {**real, "qjax.model.config": real["qjax.model.config"] | {"qjax.model.qwen3_5_moe"}}
        monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: planted)
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycles()
    elif rule == "private":
        real_imports = _imports
        monkeypatch.setattr(sys.modules[__name__], "_imports", lambda m: real_imports(m) + (
            [("qjax.checkpoint.loading", "_progress", True, 1)] if m == "qjax.checkpoint.layout" else []))
        with pytest.raises(AssertionError, match="_progress"):
            test_no_private_names_imported_across_modules()
    else:
        planted = {**real, "qjax.model.layers": real["qjax.model.layers"] | {"qjax.checkpoint.loading"}}
        monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: planted)
        with pytest.raises(AssertionError, match="qjax.model.layers"):
            test_rooms_import_only_the_rooms_below_them()
