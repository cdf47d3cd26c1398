"""``path/to/file.py:factory`` specs (warpforge._factory): a file that imports a module beside it, and the real
error when importing the file fails."""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest

from warpforge._factory import load_factory


class SpecError(ValueError):
    pass


@pytest.fixture
def names():
    """Unique module names (a run may import several such files); removed from sys.modules afterwards."""
    made: list[str] = []

    def new(stem: str) -> str:
        made.append(f"{stem}_{uuid.uuid4().hex[:8]}")
        return made[-1]

    yield new
    for n in made:
        sys.modules.pop(n, None)


def test_a_factory_file_imports_the_module_beside_it(tmp_path, names):
    helper, main = names("helper"), names("m1")
    (tmp_path / f"{helper}.py").write_text("def width():\n    return 7\n")
    (tmp_path / f"{main}.py").write_text(textwrap.dedent(f"""
        import {helper}

        def factory():
            return {helper}.width()
    """))
    path_before = list(sys.path)
    fn = load_factory(str(tmp_path / f"{main}.py"), "factory", SpecError, "_test_factory_")
    assert fn() == 7
    assert sys.path == path_before  # the folder was on the path only while the file ran


def test_a_failing_import_names_what_is_missing(tmp_path, names):
    main, missing = names("m1"), names("not_here")
    (tmp_path / f"{main}.py").write_text(f"import {missing}\n\ndef factory():\n    return 1\n")
    with pytest.raises(SpecError) as e:
        load_factory(str(tmp_path / f"{main}.py"), "factory", SpecError, "_test_factory_")
    assert f"No module named '{missing}'" in str(e.value) and "ModuleNotFoundError" in str(e.value)
    assert main not in sys.modules
