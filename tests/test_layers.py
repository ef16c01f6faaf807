"""The folders of client/tensorkv are layers: the server, and the shared layers it imports (the
top-level modules, tensorkv.optimizer, wire/, update/), import nothing of the worker's
transport/, stores/ or tools/."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLIENT = ROOT / "client" / "tensorkv"
WORKER_ONLY = ("tensorkv.transport", "tensorkv.stores", "tensorkv.tools")
SHARED = [*sorted((ROOT / "server" / "tensorkv_server").glob("*.py")),
          *(CLIENT / name for name in ("backend.py", "cuda.py", "env.py", "errors.py", "lr_scheduler.py", "words.py")),
          *(path for folder in ("optimizer", "wire", "update") for path in sorted((CLIENT / folder).glob("*.py")))]


def package_of(path):
    """The dotted name of the package of ``path``, a module of tensorkv or tensorkv_server."""
    top = CLIENT.parent if CLIENT in path.parents else path.parents[1]
    return ".".join(path.relative_to(top).parts[:-1])


def imported(path):
    """The absolute names of the modules (and of the names taken from packages) ``path`` imports."""
    package = package_of(path)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_layers_import_nothing_of_the_worker(path):
    wrong = [name for name in imported(path) if name.startswith(WORKER_ONLY)]
    assert not wrong, f"{path.relative_to(ROOT)} imports {', '.join(wrong)}"


def test_a_server_loads_no_worker_transport():
    code = ("import importlib, pkgutil, sys, tensorkv_server\n"
            "for m in pkgutil.iter_modules(tensorkv_server.__path__, 'tensorkv_server.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n.startswith(('tensorkv.transport', 'tensorkv.tools'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
