"""CPU: verify/ and common/ are layered: a library below, the command lines on top, every arrow one way.

Read from the source (ast), nothing imported: every import of a module of the repository's own (verify.*, the binding
in common/, build_step), at the top of a file or inside a function, `importlib.import_module("...")` of a constant name
included. The rules:
  * nothing imports the command-line module verify/__main__.py (`python -m verify`);
  * an entry point (verify/__main__.py, or a module that runs as `python -m verify.<name>`: it has an
    `if __name__ == "__main__":` block) is imported by no other module of verify/ or common/: the library never
    reaches up into a command line, and no command line into another;
  * no import cycle among these modules;
  * no private name (a leading underscore) crosses modules: neither `from module import _name` nor `module._name`
    where `module` is one of ours, nor a step package's private `_binding` reached from outside it.
The tests (verify/tests/) are left out: they drive the command lines and replace private parts on purpose.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_PRIVATE = {"_binding", "_kernel"}  # a step package's own modules (common/build_step.py lays them out)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """{module name: file} of verify's modules (not its tests) and common/'s Python modules, under the names they are
    imported by: verify.<name>; build_step and binding (common/ is on sys.path), binding.<name> where it is a package."""
    out = {("verify" if f.stem == "__init__" else f"verify.{f.stem}"): f for f in sorted((root / "verify").glob("*.py"))}
    for f in sorted((root / "common").rglob("*.py")):
        parts = f.relative_to(root / "common").with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


@dataclass(frozen=True)
class Import:
    importer: str
    module: str          # the module imported (or whose name is imported)
    name: str | None     # `from module import name`, where name is not itself a module; None otherwise
    line: int

    def where(self, files: dict[str, Path], root: Path = ROOT) -> str:
        return f"{files[self.importer].relative_to(root)}:{self.line}"


def is_package(module: str, files: dict[str, Path]) -> bool:
    return files[module].name == "__init__.py"


def resolve_relative(importer: str, level: int, module: str | None, files: dict[str, Path]) -> str:
    package = importer if is_package(importer, files) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return ".".join(p for p in (package, module) if p)


def imports_of(importer: str, tree: ast.AST, files: dict[str, Path]) -> list[Import]:
    """Every import in `tree` of a module in `files` (or of a name from one), wherever it stands."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                # `import a.b.c` binds a, and imports a, a.b and a.b.c: the deepest one of ours is the arrow
                ours = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files]
                if ours:
                    found.append(Import(importer, ours[0], None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(importer, node.level, node.module, files) if node.level else node.module
            for alias in node.names:
                if f"{base}.{alias.name}" in files:
                    found.append(Import(importer, f"{base}.{alias.name}", None, node.lineno))
                elif base in files:
                    found.append(Import(importer, base, alias.name, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in files):
            found.append(Import(importer, node.args[0].value, None, node.lineno))
    return found


def parsed(root: Path = ROOT) -> tuple[dict[str, Path], dict[str, ast.AST], list[Import]]:
    files = module_files(root)
    trees = {m: ast.parse(f.read_text(), filename=str(f)) for m, f in files.items()}
    return files, trees, [i for m, tree in trees.items() for i in imports_of(m, tree, files)]


def is_entry_point(module: str, tree: ast.AST) -> bool:
    """verify.__main__, or a module of verify/ with an `if __name__ == "__main__":` block of its own (common/build_step.py
    has one too, for `python common/build_step.py`, but it is the build every step's setup.py imports: a library)."""
    if module == "verify.__main__":
        return True
    if not module.startswith("verify."):
        return False
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name) \
                and node.test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                            for c in node.test.comparators):
            return True
    return False


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def private_crossings(module: str, tree: ast.AST, imports: list[Import]) -> list[tuple[int, str]]:
    """(line, what) for each private name that `module` takes from another module of ours."""
    out = [(i.line, f"from {i.module} import {i.name}") for i in imports
           if i.importer == module and i.name and i.name.startswith("_") and not i.name.startswith("__")]
    bound = {}  # local name -> our module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name if alias.asname else alias.name.split(".")[0]
                bound[alias.asname or target] = target
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound[alias.asname or alias.name] = alias.name
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
              and node.value.func.attr == "import_module" and node.value.args
              and isinstance(node.value.args[0], ast.Constant)):
            bound[node.targets[0].id] = node.value.args[0].value
    ours = {i.module.rpartition(".")[2] for i in imports if i.importer == module} | {
        i.module for i in imports if i.importer == module}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules"
                and any(f".{p}" in ast.unparse(node.slice) for p in STEP_PRIVATE)):  # sys.modules[f"flashladder.{s}._binding"]
            out.append((node.lineno, f"a step package's private module through {ast.unparse(node)}"))
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if node.attr in STEP_PRIVATE:
            out.append((node.lineno, f"a step package's private {node.attr}"))
        elif isinstance(node.value, ast.Name) and node.value.id in bound and bound[node.value.id].rpartition(".")[2] in ours:
            out.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return out


# ---------------------------------------------------------------- the rules

def layering_problems(root: Path = ROOT) -> dict[str, list[str]]:
    """Every breach of the rules in the tree at `root`, by rule (empty lists: none)."""
    files, trees, imports = parsed(root)
    entry = {m for m, t in trees.items() if is_entry_point(m, t)}
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.module != i.importer:
            edges.setdefault(i.importer, set()).add(i.module)
    return {
        "imports the command-line module verify.__main__": sorted(
            f"{i.where(files, root)}: {i.importer}" for i in imports if i.module == "verify.__main__"),
        "imports an entry point": sorted(
            f"{i.where(files, root)}: {i.importer} imports {i.module}" for i in imports
            if i.module in entry and i.module != "verify.__main__" and i.module != i.importer),
        "import cycle": [" <-> ".join(c) for c in cycles(edges)],
        "private name across modules": sorted(
            f"{files[m].relative_to(root)}:{line}: {what}" for m, t in trees.items()
            for line, what in private_crossings(m, t, imports)),
    }


def test_the_rules_see_the_modules_and_their_imports():
    """The parse finds what it must, so that an empty list of breaches below means something."""
    files, trees, imports = parsed()
    assert {"verify.__main__", "verify.steps", "verify.checks", "build_step", "binding"} <= files.keys(), sorted(files)
    assert any(i.importer == "verify.checks" and i.module == "verify.reference" for i in imports)
    assert any(i.importer == "verify.steps" and i.module == "build_step" for i in imports)
    entry = {m for m, t in trees.items() if is_entry_point(m, t)}
    assert {"verify.__main__", "verify.capstone", "verify.prefill", "verify.once"} <= entry, sorted(entry)
    assert "verify.steps" not in entry and "verify.checks" not in entry


def test_the_rules_catch_each_kind_of_breach(tmp_path):
    """A small tree with one breach of each rule: every one of them is found."""
    (tmp_path / "verify").mkdir()
    (tmp_path / "common" / "binding").mkdir(parents=True)
    files = {
        "verify/__init__.py": "",
        "verify/__main__.py": "if __name__ == '__main__':\n    pass\n",
        "verify/lib.py": "import importlib\ndef f():\n    return importlib.import_module('verify.__main__').smi()\n",
        "verify/tool.py": "def g():\n    from verify import other\nif __name__ == '__main__':\n    g()\n",
        "verify/other.py": "from verify import tool\nimport binding\nx = binding._secret\ny = tool.mod._binding\n"
                           "import sys\nz = sys.modules[f'flashladder.{x}._binding']\n",
        "verify/a.py": "from verify.b import _hidden\n",
        "verify/b.py": "def h():\n    import verify.a\n",
        "common/build_step.py": "",
        "common/binding/__init__.py": "from .abi import load\n_secret = 1\n",
        "common/binding/abi.py": "def load():\n    from . import router\n",
        "common/binding/router.py": "from .abi import load\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    found = layering_problems(tmp_path)
    assert found["imports the command-line module verify.__main__"] == ["verify/lib.py:3: verify.lib"]
    assert found["imports an entry point"] == ["verify/other.py:1: verify.other imports verify.tool"]
    assert sorted(found["import cycle"]) == ["binding.abi <-> binding.router", "verify.a <-> verify.b",
                                             "verify.other <-> verify.tool"]
    assert found["private name across modules"] == ["verify/a.py:1: from verify.b import _hidden",
                                                     "verify/other.py:3: binding._secret",
                                                     "verify/other.py:4: a step package's private _binding",
                                                     "verify/other.py:6: a step package's private module through "
                                                     "sys.modules[f'flashladder.{x}._binding']"]


def test_verify_and_common_are_layered():
    problems = {rule: found for rule, found in layering_problems().items() if found}
    assert not problems, "\n".join(f"{rule}:\n  " + "\n  ".join(found) for rule, found in problems.items())
