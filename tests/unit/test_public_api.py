"""The face (``gpumagic/__init__.py``) re-exports each owner's own function, lazily: ``help()`` and
``inspect.signature`` show the real signature and docstring, type checkers see the same names, and
``import gpumagic`` stays free of torch, bokeh, pynvml and IPython. The kernel's session is one object that the
magics and ``gpumagic.ddp_group()`` share."""

import ast
import importlib
import inspect
import pydoc
import subprocess
import sys
from pathlib import Path

import gpumagic
from gpumagic import errors
from gpumagic.launch.kernel_side.session import SESSION, ddp_group

FACE = Path(gpumagic.__file__)


def type_checking_imports() -> dict[str, tuple[str, str]]:
    """``{public name: (module, name there)}`` of the face's ``if TYPE_CHECKING:`` imports."""
    tree = ast.parse(FACE.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.asname or alias.name: (node.module, alias.name)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_every_public_name_is_its_owners_own_object_and_type_checkers_see_the_same():
    assert type_checking_imports() == gpumagic._EXPORTS
    for name, (module, attribute) in gpumagic._EXPORTS.items():
        assert getattr(gpumagic, name) is getattr(importlib.import_module(module), attribute), name
    errors_exported = {n for n in gpumagic.__all__ if isinstance(getattr(errors, n, None), type)}
    assert sorted(gpumagic.__all__) == sorted({*errors_exported, "load_ipython_extension", *gpumagic._EXPORTS})
    assert len(FACE.read_text().splitlines()) <= 200


def test_help_shows_the_real_signature_and_docstring():
    from gpumagic.devices.selection import pick

    assert inspect.signature(gpumagic.pick) == inspect.signature(pick) and gpumagic.pick.__doc__ == pick.__doc__
    assert "min_free: 'str | int | None' = None" in pydoc.render_doc(gpumagic.pick)
    shown = pydoc.render_doc(gpumagic.launch_ddp)
    assert "timeout: 'str | float' = '30m'" in shown and "hang_after: 'str | float' = '10s'" in shown
    for name in ("spawn", "ranks", "why", "jobs_with"):
        kinds = {p.kind for p in inspect.signature(getattr(gpumagic, name)).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{name} hides options in **kwargs"
    sweep = inspect.signature(gpumagic.sweep).parameters  # its job options by name; **fixed goes to fn
    assert {"name", "min_free", "ddp", "after"} <= set(sweep) and sweep["fixed"].kind is inspect.Parameter.VAR_KEYWORD
    submit = inspect.signature(gpumagic.submit).parameters
    assert [p.kind for p in submit.values()] == [
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]


def test_importing_gpumagic_loads_nothing_heavy_and_unknown_names_are_attribute_errors():
    code = (
        "import sys, gpumagic\n"
        "heavy = [m for m in ('torch', 'bokeh', 'pynvml', 'IPython', 'gpumagic.jobs.api') if m in sys.modules]\n"
        "try:\n    gpumagic.nothing_here\nexcept AttributeError as err:\n    print(heavy, err)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] module 'gpumagic' has no attribute 'nothing_here'"


def test_the_magics_and_ddp_group_share_the_kernels_session(shell):
    assert ddp_group() is None and gpumagic.ddp_group is ddp_group
    shell.run_line_magic("ddp", "start -n 1 --gpus none --no-dashboard")
    try:
        group = SESSION.group
        assert group is not None and gpumagic.ddp_group() is group and not group.closed
        assert SESSION.group_start["launch"].nprocs == 1
        group.close()  # closed outside the magics: the session forgets it
        assert gpumagic.ddp_group() is None and SESSION.group is None
        shell.run_line_magic("ddp", "restart")  # the same options (no dashboard), from the session
        assert gpumagic.ddp_group() is SESSION.group is not None and SESSION.group is not group
    finally:
        shell.run_line_magic("ddp", "stop")
    assert gpumagic.ddp_group() is None
