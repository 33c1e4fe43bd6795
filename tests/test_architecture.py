"""The import direction of STYLE.md holds, and no module grows past 600 lines.

`algo` is pure math; `models` knows no roles; nothing imports the CLI or the trainer from below.
"""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "phaserl"

# subpackage -> subpackages it must never import
FORBIDDEN = {
    "algo": {"roles", "trainer", "cli", "models", "rollout", "data", "rewards", "parallel", "config", "world"},
    "models": {"roles", "trainer", "cli", "rollout", "rewards"},
    "rollout": {"roles", "trainer", "cli"},
    "data": {"roles", "trainer", "cli", "models", "rollout"},
    "config": {"roles", "trainer", "cli", "models", "rollout", "data"},
    "rewards": {"trainer", "cli"},
    "roles": {"trainer", "cli"},
    "rm": {"trainer", "cli"},
    "doctor": {"cli"},
    "checkpoint": {"cli", "doctor"},
}
MAX_LINES = 600


def _module_parts(path: pathlib.Path) -> list:
    return list(path.relative_to(PKG.parent).with_suffix("").parts)


def _imported_phaserl_modules(path: pathlib.Path) -> set:
    """Top-level phaserl subpackages that `path` imports (absolute or relative)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_parts(path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "phaserl" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:-node.level] if path.name != "__init__.py" else here[:len(here) - node.level]
                parts = base + (node.module.split(".") if node.module else [])
                if len(parts) == 1:  # `from .. import x`: x may be a subpackage
                    parts = parts + [node.names[0].name]
            else:
                parts = (node.module or "").split(".")
            if parts and parts[0] == "phaserl" and len(parts) > 1:
                found.add(parts[1])
    return found


def _py_files():
    return sorted(p for p in PKG.rglob("*.py") if "assets" not in p.parts)


def test_import_direction():
    violations = []
    for path in _py_files():
        parts = _module_parts(path)
        if len(parts) < 2:
            continue
        sub = parts[1]
        for imported in _imported_phaserl_modules(path):
            if imported == "cli" and sub != "cli" and path.name != "__main__.py":
                violations.append(f"{path.relative_to(PKG.parent)} imports phaserl.cli")
            if imported in FORBIDDEN.get(sub, set()):
                violations.append(f"{path.relative_to(PKG.parent)} imports phaserl.{imported}")
    assert not violations, "imports against the architecture:\n" + "\n".join(violations)


def test_no_module_over_600_lines():
    big = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in _py_files()
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, "split these modules by responsibility:\n" + "\n".join(big)


def test_guard_sees_a_forbidden_import(tmp_path):
    """The checker itself works: a relative import of roles from algo is found."""
    fake = PKG / "algo" / "_fake_for_test.py"
    fake.write_text("from ..roles import actor\n")
    try:
        assert "roles" in _imported_phaserl_modules(fake)
    finally:
        fake.unlink()
