"""The layout: no test module imports another one, and no product module grows past 400
lines. What several test files share lives in tests/support/ (helpers) and tests/conftest.py
(fixtures); see tests/README.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for each import of a test module (`test_*`) in `tree`: `import
    tests.test_x`, `from .test_x import y`, `from tests.real.test_x import y`, `from . import
    test_x`, `from tests import test_x`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if any(part.startswith("test_") for part in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            dotted = "." * node.level + (node.module or "")
            if any(part.startswith("test_") for part in parts):
                found.append((node.lineno, dotted))
            elif node.level > 0 or parts[0] == "tests":
                # `from . import test_x`: the names are modules of the tests package.
                found.extend(
                    (node.lineno, f"{dotted}.{alias.name}".replace("..", "."))
                    for alias in node.names
                    if alias.name.startswith("test_")
                )
    return found


@pytest.mark.parametrize(
    "source",
    [
        "from .test_api import two_configs",
        "from tests.test_api import two_configs",
        "from tests.real.test_real_server import X",
        "import tests.test_api",
        "import test_api",
        "from . import test_api",
        "from tests import test_api",
        pytest.param("def f():\n    from .test_fakegpu import start_holder\n", id="in a function"),
    ],
)
def test_each_form_of_importing_a_test_module_is_found(source: str) -> None:
    assert imports_of_test_modules(ast.parse(source)), source


@pytest.mark.parametrize(
    "source",
    [
        "from .conftest import Proc",
        "from .support.daemon import start_daemon",
        "from tests.support import procs",
        "from . import env as real_env",
        "from gpuwarden.daemon.testing import test_helper",
        "import pytest",
    ],
)
def test_imports_of_support_and_other_modules_pass(source: str) -> None:
    assert imports_of_test_modules(ast.parse(source)) == [], source


def test_no_test_module_imports_another() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}: imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imports_of_test_modules(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, (
        "a test module imports another test module; move what is shared into tests/support/ "
        "(helpers) or tests/conftest.py (fixtures):\n" + "\n".join(offenders)
    )


MODULE_LINE_LIMIT = 400


def test_every_product_module_stays_under_the_line_limit() -> None:
    """Each module of the product (daemon/, api/, standin/) stays readable in one sitting: a
    module that outgrows the limit is split by what it decides, not trimmed."""
    root = TESTS.parent
    too_long = [
        f"{path.relative_to(root)}: {count} lines"
        for folder in ("daemon", "api", "standin")
        for path in sorted((root / folder).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) >= MODULE_LINE_LIMIT
    ]
    assert not too_long, f"modules at or over {MODULE_LINE_LIMIT} lines:\n" + "\n".join(too_long)
