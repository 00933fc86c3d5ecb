"""An API a user can hold in their head: the optimizer's face, the exported names, and functions
small enough to read (read from the sources with :mod:`ast`, nothing imported but the optimizer).

Kernels are exempt from the parameter bar: ``@triton.jit`` functions, an autograd ``Function``'s
``forward``/``backward`` and a ``torch.library`` operator's implementation or fake take what their
launch, autograd or the operator's flat schema hands them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_architecture_doc import MAX_DOCSTRING_LINES, ROOT, SOURCES, _docstring_lines, _modules

from memopt_plugins import MemoryOptimizer

MAX_PUBLIC_MEMBERS = 12
MAX_EXPORTED = 50
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
MAX_FUNCTIONS_OVER_PARAMETERS = 3


def _public_members(opt: MemoryOptimizer) -> set[str]:
    """Names without a leading underscore on the class, and the instance's public attributes."""
    on_class = {n for n in dir(type(opt)) if not n.startswith("_")}
    return on_class | {n for n in vars(opt) if not n.startswith("_")}


def test_the_optimizer_has_at_most_twelve_public_members():
    members = _public_members(MemoryOptimizer())
    assert len(members) <= MAX_PUBLIC_MEMBERS, sorted(members)
    # one way to ask each question: no synonyms of what stays
    assert members.isdisjoint(
        {"maybe_check_drift", "should_check", "recomputes", "recomputed", "recompute_plan"}
    )
    assert members.isdisjoint({"bits_mean", "batch_fits", "measured_fits", "hooks", "steps"})


def test_the_member_count_sees_methods_properties_and_instance_attributes():
    class Shaped(MemoryOptimizer):
        def extra(self) -> None: ...

    opt = Shaped()
    opt.added = 1
    members = _public_members(opt)
    assert {"extra", "added", "config", "plan", "apply"} <= members
    assert len(members) == len(_public_members(MemoryOptimizer())) + 2


def _exported(path: Path) -> list[str]:
    """The names in a module's ``__all__`` (empty without one)."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def test_all_lists_hold_at_most_fifty_names_in_all():
    exported = {str(p): _exported(ROOT / p) for p in _modules()}
    total = sum(len(names) for names in exported.values())
    assert total <= MAX_EXPORTED, {p: n for p, n in exported.items() if n}
    # what the README imports is among them
    assert {"MemoryOptimizer", "MemOptConfig", "plan_recompute"} <= set(
        exported["memopt_plugins/__init__.py"]
    )


def test_exported_names_are_read_from_every_form_of_all(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text('__all__: list[str] = ["a", "b"]\n')
    assert _exported(source) == ["a", "b"]
    source.write_text('x = 1\n__all__ = ["c"]\n')
    assert _exported(source) == ["c"]
    source.write_text("x = 1\n")
    assert _exported(source) == []


def test_module_docstrings_stay_short():
    """The bar ``test_architecture_doc`` keeps, asserted with the rest of the API's shape."""
    lines = {str(p): _docstring_lines((ROOT / p).read_text()) for p in _modules()}
    assert {p: n for p, n in lines.items() if n > MAX_DOCSTRING_LINES} == {}


def _functions() -> list[tuple[str, ast.FunctionDef, ast.ClassDef | None]]:
    """Every function and method of the sources, with the class it is defined in (if any)."""
    found = []

    def walk(node: ast.AST, cls: ast.ClassDef | None, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, child, where)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{where}:{child.lineno} {child.name}", child, cls))
                walk(child, None, where)
            else:
                walk(child, cls, where)

    for root in SOURCES:
        for path in sorted((ROOT / root).rglob("*.py")):
            walk(ast.parse(path.read_text()), None, str(path.relative_to(ROOT)))
    return found


def _operator_implementations() -> set[str]:
    """Names of the functions handed to ``torch.library.custom_op(name, fn, ...)``."""
    names = set()
    for root in SOURCES:
        for path in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("custom_op"):
                    names |= {a.id for a in node.args[1:2] if isinstance(a, ast.Name)}
    return names


def _is_kernel(fn: ast.FunctionDef, cls: ast.ClassDef | None) -> bool:
    decorators = [ast.unparse(d) for d in fn.decorator_list]
    if any("jit" in d or "custom_op" in d or d.endswith("register_fake") for d in decorators):
        return True
    if cls is None and fn.name in _OPERATORS:
        return True
    autograd = cls is not None and any("Function" in ast.unparse(b) for b in cls.bases)
    return autograd and fn.name in ("forward", "backward")


_OPERATORS = _operator_implementations()


def _parameters(fn: ast.FunctionDef) -> int:
    """Parameters a caller passes: ``self``/``cls`` left out, ``*args``/``**kwargs`` one each."""
    args = fn.args
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    named = [n for n in named if n not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def test_the_function_walk_finds_methods_nested_functions_and_kernels():
    functions = {name.split(" ")[1]: (fn, cls) for name, fn, cls in _functions()}
    assert "check_drift" in functions and "plan_recompute" in functions
    fn, cls = functions["check_drift"]
    assert cls is not None and cls.name == "MemoryOptimizer" and not _is_kernel(fn, cls)
    assert _parameters(fn) == 6  # loss_fn, batch, step, batch_size, max_rounds, if_due
    assert any(_is_kernel(fn, cls) for _, fn, cls in _functions())


def test_no_function_is_over_eighty_lines():
    long = {
        name: fn.end_lineno - fn.lineno + 1
        for name, fn, _ in _functions()
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_at_most_three_functions_besides_kernels_take_over_eight_parameters():
    many = {
        name: _parameters(fn)
        for name, fn, cls in _functions()
        if _parameters(fn) > MAX_PARAMETERS and not _is_kernel(fn, cls)
    }
    assert len(many) <= MAX_FUNCTIONS_OVER_PARAMETERS, many
