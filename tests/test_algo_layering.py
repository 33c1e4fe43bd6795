"""phaserl.algo stays pure math: no nn.Module, no torch.distributed, no I/O, no upward imports."""
import ast
import pathlib

import phaserl.algo

ALGO_DIR = pathlib.Path(phaserl.algo.__file__).parent
ALLOWED_ROOTS = {"__future__", "dataclasses", "functools", "inspect", "typing", "math", "torch",
                 "triton"}  # the same math as GPU kernels (logprob_kernels.py), imported only when used
ALLOWED_PHASERL = {"phaserl.errors", "phaserl.algo"}
FORBIDDEN_NAMES = {"open", "print", "nn", "distributed", "Module"}


def _modules():
    files = sorted(ALGO_DIR.glob("*.py"))
    assert len(files) >= 8
    return [(f.name, ast.parse(f.read_text())) for f in files]


def test_algo_imports_only_torch_the_stdlib_basics_and_phaserl_errors():
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            else:
                continue
            for target in targets:
                if target.startswith("phaserl"):
                    assert any(target == p or target.startswith(p + ".") for p in ALLOWED_PHASERL), (name, target)
                else:
                    assert target.split(".")[0] in ALLOWED_ROOTS, (name, target)
                    assert "distributed" not in target and not target.startswith("torch.nn"), (name, target)


def test_algo_uses_no_module_classes_no_distributed_and_no_io():
    for name, tree in _modules():
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not used & FORBIDDEN_NAMES, (name, used & FORBIDDEN_NAMES)


def test_every_public_function_has_a_docstring():
    for name, tree in _modules():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                assert ast.get_docstring(node), f"{name}: {node.name} has no docstring"
