"""lazy.use_bytecode_cache: where Python may not write bytecode and an installed package has none, torpor's
own processes keep it in torpor's cache instead of compiling every module at every start."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(tmp_path, env: dict, code: str) -> str:
    """`code` in a new interpreter with `tmp_path/site` (a package without bytecode) on its path."""
    site = tmp_path / "site"
    (site / "nobytecode").mkdir(parents=True, exist_ok=True)
    (site / "nobytecode" / "__init__.py").write_text("VALUE = 42\n")
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]), **env)
    full.pop("PYTHONPYCACHEPREFIX", None)
    for key, value in env.items():
        if value is None:
            full.pop(key)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


CALL = """
    import sys
    from torpor.lazy import use_bytecode_cache
    folder = use_bytecode_cache({cache!r}, package="nobytecode")
    import nobytecode
    print(folder, sys.dont_write_bytecode, nobytecode.VALUE)
"""


def test_bytecode_goes_to_torpors_cache_where_python_may_not_write_it(tmp_path):
    cache = str(tmp_path / "cache")
    out = run(tmp_path, {"PYTHONDONTWRITEBYTECODE": "1"}, CALL.format(cache=cache))
    assert out == f"{cache}/pycache False 42"
    written = [f for _, _, files in os.walk(cache) for f in files if f.endswith(".pyc")]
    assert any(f.startswith("__init__.") for f in written)  # nobytecode's, under the prefix
    assert not (tmp_path / "site" / "nobytecode" / "__pycache__").exists()  # nothing beside the sources


@pytest.mark.parametrize(("env", "why"), [
    ({"PYTHONDONTWRITEBYTECODE": None}, "Python may write bytecode beside the sources"),
])
def test_nothing_changes_otherwise(tmp_path, env, why):
    out = run(tmp_path, env, CALL.format(cache=str(tmp_path / "cache")))
    assert out.startswith("None"), why
    assert not (tmp_path / "cache").exists()


def test_a_package_with_its_bytecode_installed_needs_no_cache(tmp_path):
    run(tmp_path, {"PYTHONDONTWRITEBYTECODE": None}, "import nobytecode")  # writes its __pycache__ beside it
    out = run(tmp_path, {"PYTHONDONTWRITEBYTECODE": "1"}, CALL.format(cache=str(tmp_path / "cache")))
    assert out.startswith("None")
