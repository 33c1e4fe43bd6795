"""The layout of phaserl/ is the architecture: every package and top-level module has one row below
saying which other units it may import, the rows form layers (no cycles: arrows only point down),
the README's layout tree lists the same units, and no module grows past 600 lines.

Imports are read from the source (`ast`), wherever they are: at the top, inside functions, under
`if TYPE_CHECKING:`. A new package or module needs a row here and a line in the README's tree.
"""
import ast
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[1] / "phaserl"
README = PKG.parent / "README.md"
MAX_LINES = 600
ROOT = "phaserl"  # phaserl/__init__.py itself (`from .. import __version__` imports it)

# unit -> the phaserl units it may import. Bottom layer first; README's layout tree says what each is.
ALLOWED = {
    "errors": set(),
    "userfiles": {"errors"},                           # user code named in a config (file.py or module)
    "compile_cache": set(),                            # torch.compile's persistent caches: torch only
    "cuda_allocator": set(),                           # torch's CUDA allocator settings: torch only
    "batch": set(),                                    # typed data between phases: torch only
    ROOT: {"errors"},                                  # public names, loaded lazily
    "config": {"errors"},
    "algo": {"errors"},                                # pure tensor math
    "models": {"compile_cache", "errors"},
    "parallel": {"errors"},
    "data": {"errors"},
    "report": {"errors"},
    "batching": {"batch"},
    "packing": {"batch", "models"},
    "rollout": {"compile_cache", "errors", "models"},
    "metrics": {"parallel"},
    "rewards": {"batch", "errors", "userfiles"},                    # a reward model is any `score(prompts, responses)`
    "roles": {"algo", "batch", "batching", "errors", "models", "packing", "parallel", "rollout"},
    "agents": {"batch", "data", "errors", "models", "rewards", "rollout", "userfiles"},  # never trainer, cli, roles
    "world": {"agents", "data", "errors", "models", "rewards"},    # agent_task: the tiny multi-turn world
    "rm": {"config", "data", "errors", "models", "roles", "world"},
    "checkpoint": {ROOT, "config", "errors", "models", "parallel"},
    "memory": {"config", "errors", "models", "rollout"},  # the budget in bytes and the plan (config.auto's rules)
    "resolve": {"config", "errors", "parallel", "rewards", "rm", "roles", "world"},  # names -> things
    "doctor": {"agents", "checkpoint", "config", "cuda_allocator", "data", "errors", "memory", "models", "parallel",
               "resolve", "rewards", "roles", "rollout"},  # rollout: generate() for the agent episode probe
    "trainer": {"agents", "algo", "batch", "checkpoint", "compile_cache", "config", "cuda_allocator", "data", "errors",
                "memory", "metrics", "models", "parallel", "report", "resolve", "rewards", "rm", "roles", "rollout"},
    "cli": {"config", "doctor", "errors", "parallel", "resolve", "rm", "trainer", "world"},
    "__main__": {"cli"},
}
NOT_IN_README = {ROOT, "__main__"}  # the package's own __init__.py and `python -m phaserl`


def _units() -> set:
    """Every package and top-level module under phaserl/, by name (the root's __init__.py is ROOT)."""
    names = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    return {ROOT if n == "__init__" else n for n in names}


def _unit_of(parts: list, units: set) -> str:
    """The unit that the dotted module `parts` (starting with 'phaserl') belongs to."""
    return parts[1] if len(parts) > 1 and parts[1] in units else ROOT


def _imported_units(source: str, module: list, *, is_package: bool, units: set) -> set:
    """The phaserl units that the module `module` (dotted parts, e.g. ['phaserl', 'algo', 'kl']) imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package that holds the module (the module itself, for __init__)
                package = module if is_package else module[:-1]
                base = package[:len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
                # `from .. import x`: x may be a unit (a subpackage or module)
                targets = [parts + [alias.name] for alias in node.names] if len(parts) == 1 else [parts]
            else:
                targets = [(node.module or "").split(".")]
        else:
            continue
        found |= {_unit_of(t, units) for t in targets if t[0] == "phaserl"}
    return found


def _py_files() -> list:
    return sorted(p for p in PKG.rglob("*.py") if "assets" not in p.parts)


def _module_parts(path: pathlib.Path) -> list:
    return list(path.relative_to(PKG.parent).with_suffix("").parts)


def test_every_package_and_module_has_a_row():
    units = _units()
    new = sorted(units - ALLOWED.keys())
    assert not new, (f"phaserl/{new[0]} has no row in tests/test_architecture.py's ALLOWED table: add one saying "
                     f"which phaserl packages it may import (and a line in the README's layout tree); new: {new}")
    gone = sorted(ALLOWED.keys() - units)
    assert not gone, f"ALLOWED has rows for units that no longer exist under phaserl/: {gone}; remove them"


def test_imports_follow_the_table():
    units = _units()
    violations = []
    for path in _py_files():
        parts = _module_parts(path)
        module = parts[:-1] if path.name == "__init__.py" else parts
        here = _unit_of(module, units)
        for imported in _imported_units(path.read_text(), module, is_package=path.name == "__init__.py",
                                        units=units) - {here}:
            if imported not in ALLOWED.get(here, set()):
                allowed = ", ".join(sorted(ALLOWED.get(here, ()))) or "nothing"
                violations.append(f"{path.relative_to(PKG.parent)} imports phaserl.{imported}, which "
                                  f"{here} may not (its row allows: {allowed})")
    assert not violations, "imports against the architecture:\n" + "\n".join(violations)


def test_the_table_is_layered():
    """No cycle among the allowed imports: each unit can be placed above everything it imports."""
    placed, remaining = set(), dict(ALLOWED)
    while remaining:
        ready = [u for u, deps in remaining.items() if deps <= placed]
        assert ready, f"the ALLOWED table has a cycle among: {sorted(remaining)}"
        placed |= set(ready)
        for u in ready:
            del remaining[u]


def test_nothing_imports_the_trainer_or_the_cli():
    assert {u for u, deps in ALLOWED.items() if "trainer" in deps} == {"cli"}
    assert {u for u, deps in ALLOWED.items() if "cli" in deps} == {"__main__"}


TOOLS = {"doctor"}  # it reads the library and reports; a formula both need lives below both (phaserl.memory)


def test_the_library_never_imports_its_tools():
    """The doctor is a leaf: only the command line runs it. A run that imported the doctor would load the preflight
    tool on every step's path, and the tool would sit below what it checks."""
    for tool in TOOLS:
        users = {u for u, deps in ALLOWED.items() if tool in deps}
        assert users <= {"cli"}, f"{sorted(users - {'cli'})} may import phaserl.{tool}: move what they need below both"
    importers = [f"{p.relative_to(PKG.parent)} imports phaserl.{tool}" for p in _py_files()
                 for tool in TOOLS & _imported_units(p.read_text(), _module_parts(p),
                                                     is_package=p.name == "__init__.py", units=_units())
                 if _unit_of(_module_parts(p), _units()) not in TOOLS | {"cli"}]
    assert not importers, "the library imports a tool:\n" + "\n".join(importers)


def test_the_readme_layout_tree_lists_every_unit():
    text = README.read_text()
    tree = text[text.index("## Layout"):]
    tree = tree[tree.index("```") + 3:]
    tree = tree[:tree.index("```")]
    listed = set(re.findall(r"^  ([a-z_]+)(?:/|\.py)\s", tree, flags=re.M))
    expected = _units() - NOT_IN_README
    assert listed == expected, (f"README.md's layout tree and phaserl/ differ: missing from the README "
                                f"{sorted(expected - listed)}, not in phaserl/ {sorted(listed - expected)}")


def test_no_module_over_600_lines():
    big = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in _py_files()
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, "split these modules by responsibility:\n" + "\n".join(big)


def test_the_checker_sees_every_form_of_import():
    """Relative (from a module and from a package's __init__), absolute, `from .. import unit`, and inside
    a function or `if TYPE_CHECKING:` all count."""
    units = {"algo", "roles", "trainer", "rollout", "cli", "errors", ROOT}
    source = ("from ..roles import actor\n"
              "import phaserl.rollout.engine\n"
              "from .. import cli\n"
              "from . import kl\n"
              "from .. import __version__\n"
              "if TYPE_CHECKING:\n    from phaserl.errors import ConfigError\n"
              "def f():\n    from ..trainer import RLTrainer\n")
    assert _imported_units(source, ["phaserl", "algo", "x"], is_package=False, units=units) == {
        "roles", "rollout", "cli", "algo", ROOT, "errors", "trainer"}
    # in algo/__init__.py, `..` is phaserl/ too; `.` is algo itself
    assert _imported_units("from ..roles import a\nfrom .kl import b\n", ["phaserl", "algo"], is_package=True,
                           units=units) == {"roles", "algo"}


def test_the_layer_math_is_written_once_for_training_and_rollout():
    """models/layers.py holds the families' layer pieces; the decoder and the engine's runner import them and
    define none of their own (a family added there is right in both: parity by construction)."""
    pieces = {"rms_norm", "rotate", "rope_tables", "pre_attention", "post_attention", "embed", "activation"}
    layers = PKG / "models" / "layers.py"
    defined = {n.name for n in ast.walk(ast.parse(layers.read_text())) if isinstance(n, ast.FunctionDef)}
    assert pieces <= defined
    assert _imported_units(layers.read_text(), ["phaserl", "models", "layers"], is_package=False,
                           units=_units()) <= {"models", "errors"}
    # the engine's runner takes its layer functions from rollout/layer_fns.py
    for user in (PKG / "models" / "decoder.py", PKG / "rollout" / "runner.py", PKG / "rollout" / "layer_fns.py"):
        tree = ast.parse(user.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)} & pieces
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "phaserl.models.layers" for a in n.names}
        assert not own, f"{user.name} restates layer pieces {sorted(own)}: use phaserl.models.layers"
        if user.name != "runner.py":
            assert {"pre_attention", "post_attention"} <= imported, f"{user.name} must run layers.py's pieces"


def test_adapters_import_their_ecosystems_only_when_used():
    """phaserl/agents/adapters/*: a module's top level imports the standard library and phaserl only; the
    ecosystem's package (verifiers, textarena, reasoning-gym, openai, ...) is imported inside the functions that
    use it, so every adapter module imports without its extra and the extras stay optional."""
    import sys

    allowed = set(sys.stdlib_module_names) | {"phaserl", "__future__"}
    for path in sorted((PKG / "agents" / "adapters").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            outside = [n for n in names if n.split(".")[0] not in allowed]
            assert not outside, (f"{path.relative_to(PKG.parent)} imports {outside} at its top level: import the "
                                 "ecosystem's package inside the function that uses it")


def test_lora_is_a_thin_seam_over_the_built_model():
    """models/lora.py wraps projections by name after a model is built: it needs no decoder internals (only
    phaserl.errors), and the decoder's layer math does not know about it (the adapters sit in its Linear slots)."""
    lora = PKG / "models" / "lora.py"
    units = _units()
    assert _imported_units(lora.read_text(), ["phaserl", "models", "lora"], is_package=False, units=units) <= {
        "errors"}
    assert "lora" not in (PKG / "models" / "decoder.py").read_text()


def test_the_expert_mixture_is_written_once_in_models_moe():
    """models/moe.py holds the MoE math (routing, expert mixtures, aux loss) and imports nothing of phaserl; the
    decoder, the engine's runner and the layer pieces reach it through layers.post_attention, never restate it."""
    moe = PKG / "models" / "moe.py"
    assert _imported_units(moe.read_text(), ["phaserl", "models", "moe"], is_package=False, units=_units()) == set()
    pieces = {n.name for n in ast.parse(moe.read_text()).body
              if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    for user in PKG.rglob("*.py"):
        if user != moe:
            own = {n.name for n in ast.walk(ast.parse(user.read_text())) if isinstance(n, ast.FunctionDef)} & pieces
            assert not own, f"{user.relative_to(PKG)} restates MoE pieces {sorted(own)}: use phaserl.models.moe"
