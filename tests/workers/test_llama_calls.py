"""Every call the engine makes into llama.cpp's C API passes as many arguments as the pinned
llama-cpp-python declares. ctypes checks a call's arity only when it runs, and some run only
for rare requests: a repeat_penalty once called llama_sampler_init_penalties with four
arguments of five, and the TypeError ended the engine process with every stream in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llama_cpp

from tests.conftest import ROOT

ENGINE = ROOT / "workers" / "engine"


def llama_calls(path: Path):
    """(line, function name, positional arguments) of each `L.<name>(...)` call in a file
    that imports llama_cpp as L."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "L"
        ):
            yield node.lineno, node.func.attr, node.args


def test_every_llama_cpp_call_passes_the_declared_arguments():
    checked, wrong = 0, []
    for path in sorted(ENGINE.glob("*.py")):
        for line, name, args in llama_calls(path):
            fn = getattr(llama_cpp, name, None)
            if fn is None:
                wrong.append(f"{path.name}:{line} {name}: not in llama_cpp")
                continue
            argtypes = getattr(fn, "argtypes", None)
            if argtypes is None or any(isinstance(a, ast.Starred) for a in args):
                continue  # a constant, a Python helper or a call with *args
            checked += 1
            if len(args) != len(argtypes):
                wrong.append(f"{path.name}:{line} {name}: {len(args)} arguments, wants "
                             f"{len(argtypes)}")  # fmt: skip
    assert not wrong, wrong
    assert checked > 50  # the engine's calls were found and checked


def test_the_check_finds_a_call_with_too_few_arguments(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import llama_cpp as L\nL.llama_sampler_init_penalties(64, 1.1, 0.0, 0.0)\n")
    [(line, name, args)] = list(llama_calls(bad))
    assert name == "llama_sampler_init_penalties" and line == 2
    assert len(args) != len(llama_cpp.llama_sampler_init_penalties.argtypes)
