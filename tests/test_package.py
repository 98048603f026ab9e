"""A package people can depend on: `python -m build` makes an sdist and a wheel that twine accepts,
the wheel carries the licence and its metadata, and installed in a fresh virtual environment it runs
`pycapsnet --version` (dependencies from the environment this test runs in: nothing is downloaded)."""
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import pycapsnet

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    pytest.importorskip("build", reason="python -m build comes with the [test] extra")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_sdist_and_wheel_pass_twine_and_carry_the_licence(dist):
    pytest.importorskip("twine", reason="twine comes with the [test] extra")
    files = sorted(p.name for p in dist.iterdir())
    assert any(f.endswith(".whl") for f in files) and any(f.endswith(".tar.gz") for f in files), files
    done = subprocess.run([sys.executable, "-m", "twine", "check", *map(str, dist.iterdir())],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
        names = z.namelist()
        assert any(n.endswith("LICENSE") for n in names)
    # one top-level name: backends/ goes in as pycapsnet.backends; the built-in descriptions come along
    assert "pycapsnet/backends/__init__.py" in names and "pycapsnet/networks/efficient.json" in names
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))} == {"pycapsnet"}
    assert "License-Expression: MIT" in meta or "License: MIT" in meta
    assert "Author: the pycapsnet authors" in meta and "Project-URL" in meta and "Requires-Python: >=3.9" in meta


def test_the_wheel_installs_in_a_fresh_environment_and_runs(dist, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, system_site_packages=True, with_pip=True)
    python = env / "bin" / "python"
    wheel = next(dist.glob("*.whl"))
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([str(env / "bin" / "pycapsnet"), "--version"], capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"pycapsnet {pycapsnet.__version__}", done.stderr
    # The dependencies are this interpreter's. Made from a virtual environment, the new one's system
    # site-packages are the base Python's, which may lack them: name this one's too, after the new
    # environment's own (a plain path per line, so the checkout's editable install is not loaded).
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "the_tests_interpreter.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    code = ("import pycapsnet, pycapsnet.backends as b; print(pycapsnet.__file__, b.__file__); "
            "print(pycapsnet.build('efficient').network.n_params())")
    where = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    files, count = where.stdout.splitlines()
    assert all(str(env) in f for f in files.split()), where.stdout + where.stderr  # the wheel's copy, not this checkout's
    assert int(count) > 161_824  # the described network, read from the installed package's data
    shutil.rmtree(env)


def test_every_module_parses_and_annotates_as_python_3_9_does():
    """setup.py declares python_requires >= 3.9: every module parses with 3.9's grammar, and one whose
    annotations use ``X | Y`` (3.10's) defers them (``from __future__ import annotations``), else
    3.9 raises as the module is imported (issue 105: pycapsnet/__init__.py did)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    for path in sorted([*root.glob("pycapsnet/**/*.py"), *root.glob("backends/*.py")]):
        if "pycapsnet/backends/" in path.as_posix():  # the link to backends/, checked there
            continue
        tree = ast.parse(path.read_text(), feature_version=(3, 9))
        deferred = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
                       any(a.name == "annotations" for a in n.names) for n in tree.body)
        annotations = [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        annotations += [a.annotation for n in ast.walk(tree) if isinstance(n, ast.arguments)
                        for a in [*n.args, *n.kwonlyargs, *n.posonlyargs]]
        annotations += [n.annotation for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
        unions = [a for a in annotations if a is not None and any(
            isinstance(b, ast.BinOp) and isinstance(b.op, ast.BitOr) for b in ast.walk(a))]
        assert deferred or not unions, f"{path.relative_to(root)}:{unions[0].lineno}: X | Y without the future import"


# The house's floors (issue 108), lowest first: a module imports only from its own floor or below
FLOORS = (
    ("core and backends", ("pycapsnet.core", "pycapsnet.backends", "pycapsnet.errors", "pycapsnet.arrays",
                           "pycapsnet.arguments", "pycapsnet.userfiles", "pycapsnet.networks")),
    ("the tools they share", ("pycapsnet.training", "pycapsnet.tools", "pycapsnet.plugins")),
    ("the public faces", ("pycapsnet.study", "pycapsnet.experiments", "pycapsnet.routings", "pycapsnet.datasets",
                          "pycapsnet.api", "pycapsnet.torch", "pycapsnet.torch_ops", "pycapsnet.torch_support", "pycapsnet.optim",
                          "pycapsnet")),
    ("the command line", ("pycapsnet.tools.cli", "pycapsnet.__main__")),
)


def _floor(module: str) -> int:
    best = max((len(prefix), k) for k, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + "."))
    return best[1]


def _imports(root: Path):
    """(module, imported module, line) of every import in pycapsnet, at a module's top or in a function."""
    import ast

    for path in sorted(root.glob("pycapsnet/**/*.py")):
        if "pycapsnet/backends/" in path.as_posix():
            continue
        rel = path.relative_to(root).with_suffix("").parts
        package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
        module = ".".join(rel if rel[-1] != "__init__" else rel[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = list(package[:len(package) - node.level + 1]) if node.level else []
                base = ".".join(base + ([node.module] if node.module else []))
                if not base.startswith("pycapsnet"):
                    continue
                subs = [f"{base}.{a.name}" for a in node.names]
                subs = [s for s in subs if (root / (s.replace(".", "/") + ".py")).exists()
                        or (root / s.replace(".", "/")).is_dir()]
                for target in subs or [base]:
                    yield module, target, [a.name for a in node.names], node.lineno
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pycapsnet"):
                        yield module, a.name, [], node.lineno


def test_imports_go_one_way_down_and_no_private_name_crosses_a_package():
    root = Path(__file__).resolve().parent.parent
    upward, private = [], []
    for module, target, names, line in _imports(root):
        if _floor(target) > _floor(module):
            upward.append(f"{module}:{line} imports {target} ({FLOORS[_floor(target)][0]} above "
                          f"{FLOORS[_floor(module)][0]})")
        same_package = target.rsplit(".", 1)[0] == module.rsplit(".", 1)[0] or target.startswith(module + ".")
        hidden = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if hidden and not same_package and target != "pycapsnet.backends.base":
            private.append(f"{module}:{line} takes {hidden} from {target}")
    assert not upward, "\n".join(upward)
    assert not private, "\n".join(private)


def test_no_private_name_is_read_off_a_module_of_another_package():
    """``folder._some(...)`` where ``folder`` is a module of another package (what the imports
    alone do not show); attributes of objects are not seen statically."""
    import ast

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted(root.glob("pycapsnet/**/*.py")):
        if "pycapsnet/backends/" in path.as_posix():
            continue
        rel = path.relative_to(root).with_suffix("").parts
        package = ".".join(rel[:-1])
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> the pycapsnet module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = list(rel[:len(rel) - node.level]) if node.level else []
                base = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}"
                    if target.startswith("pycapsnet") and (root / (target.replace(".", "/") + ".py")).exists():
                        modules[a.asname or a.name] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                target = modules[node.value.id]
                if node.attr.startswith("_") and not node.attr.startswith("__") and \
                        target.rsplit(".", 1)[0] != package:
                    found.append(f"{'.'.join(rel)}:{node.lineno} reads {node.attr} off {target}")
    assert not found, "\n".join(found)
