"""Every annotation of the package is a type expression (issue 44, item 6).

Shapes are jaxtyping types (``Float[Array, "n d"]``), never a string such as ``"float[n d]"``:
a string is no type, and ``typing.get_type_hints`` raises on it, so neither beartype (the
suite's run-time checks, tests/typecheck.py) nor a static checker can read it.

Two checks, on every module of the package (a module that cannot be imported fails the test):

* ``typing.get_type_hints(obj, include_extras=True)`` succeeds for every function and every
  method (plain, static, class, property) of every class defined in the module (names the
  module imports under ``if TYPE_CHECKING:`` resolve, as a static checker resolves them);
* no function argument, return or variable annotation holds a string that spells a shape
  (``"float[n d]"``, ``"int32[T]"``, ``"[V d]"``, ``"bool[U] | None"``), read from the source
  with ``ast`` (with ``from __future__ import annotations`` the annotations are strings at run
  time, so only the source tells a quoted shape from a type).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import typing

import pytest

import powerlens

# a string written as a shape: an optional dtype word, then a bracket ("float[n d]", "int32[T]",
# "[V d]"); jaxtyping's own dimension strings ("n d", "*batch n", "") never start so
SHAPE_STRING = re.compile(r"^\s*(?:(?:float|int|uint|bool|complex|real|num|shaped)\w*\s*)?\[", re.IGNORECASE)


def _modules():
    """``(names, errors)``: every module of the package, imported, and ``{name: error}`` of
    those that could not be (a package whose import fails hides its modules: it is an error)."""
    errors = {}
    names = ["powerlens"]
    for info in pkgutil.walk_packages(powerlens.__path__, "powerlens.",
                                      onerror=lambda name: errors.setdefault(name, "package import failed")):
        names.append(info.name)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:       # noqa: BLE001 - reported by the test
            errors[name] = f"{type(exc).__name__}: {exc}"
    return sorted(set(names)), errors


MODULES, IMPORT_ERRORS = _modules()


def _defined_in(module):
    """``{qualified name: function}`` of every function and method defined in ``module``
    (wrappers unwrapped: jax.jit, functools.wraps, the suite's type-checking wrapper)."""
    out = {}

    def add(qual, obj):
        fn = inspect.unwrap(obj) if callable(obj) else obj
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            out[qual] = fn

    for name, value in vars(module).items():
        if inspect.isclass(value):
            if value.__module__ != module.__name__:
                continue
            for attr, member in vars(value).items():
                if isinstance(member, (staticmethod, classmethod)):
                    add(f"{name}.{attr}", member.__func__)
                elif isinstance(member, property):
                    for part in (member.fget, member.fset, member.fdel):
                        if part is not None:
                            add(f"{name}.{attr}", part)
                elif callable(member):
                    add(f"{name}.{attr}", member)
        elif callable(value):
            add(name, value)
    return out


def test_every_module_imports():
    assert len(MODULES) > 50, MODULES
    assert not IMPORT_ERRORS, IMPORT_ERRORS


def _type_checking_names(module):
    """``{name: object}`` the module imports under ``if TYPE_CHECKING:`` (names its annotations
    may use without importing them at run time), imported here."""
    names = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
                    source = importlib.import_module("." * stmt.level + (stmt.module or ""), package)
                    for alias in stmt.names:
                        names[alias.asname or alias.name] = getattr(source, alias.name)
                elif isinstance(stmt, ast.Import):
                    for alias in stmt.names:
                        names[alias.asname or alias.name.partition(".")[0]] = importlib.import_module(
                            alias.name if alias.asname else alias.name.partition(".")[0])
    return names


@pytest.mark.parametrize("name", MODULES)
def test_type_hints_resolve(name):
    module = importlib.import_module(name)
    functions = _defined_in(module)
    local = _type_checking_names(module)
    bad = {}
    for qual, fn in functions.items():
        try:
            typing.get_type_hints(fn, localns=local, include_extras=True)
        except Exception as exc:       # noqa: BLE001 - reported by the test
            bad[qual] = f"{type(exc).__name__}: {exc}"
    assert not bad, f"{name}: annotations that are not types: {bad}"


def _shape_strings(tree):
    """``[(line, where, text)]`` of every string constant in an annotation that spells a shape."""
    found = []

    def scan(where, annotation):
        for node in ast.walk(annotation):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SHAPE_STRING.match(node.value):
                found.append((annotation.lineno, where, node.value))

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None:
                    scan(f"{node.name}({arg.arg})", arg.annotation)
            if node.returns is not None:
                scan(f"{node.name} -> ", node.returns)
        elif isinstance(node, ast.AnnAssign):
            scan(ast.unparse(node.target), node.annotation)
    return found


@pytest.mark.parametrize("name", MODULES)
def test_no_shape_strings(name):
    source = inspect.getsource(importlib.import_module(name))
    found = _shape_strings(ast.parse(source))
    assert not found, f"{name}: shape annotations written as strings (use jaxtyping): {found}"


def test_shape_strings_detected():
    """The AST check finds a quoted shape and leaves jaxtyping's dimension strings alone."""
    tree = ast.parse('def f(X: "float[n d]", m: "bool[U] | None", W: "[V d]", k: "int32[T]") -> "float[n]": ...\n'
                     'def g(X: Float[Array, "*batch n d"], s: Float[ArrayLike, ""]) -> Int[Array, "n"]: ...\n'
                     'y: "float[n d]" = 0\n')
    assert [(w, s) for _, w, s in _shape_strings(tree)] == [
        ("f(X)", "float[n d]"), ("f(m)", "bool[U] | None"), ("f(W)", "[V d]"), ("f(k)", "int32[T]"),
        ("f -> ", "float[n]"), ("y", "float[n d]")]
