"""pytest plugin of the conformance kit (entry point ``pytest11: kvabi``).

``pytest --kvabi-backend NAME`` (repeatable) adds the :class:`BackendConformance` tests of
each named backend to the session, as if a test file subclassed it.  ``--kvabi-profile``
(or ``KVABI_HYPOTHESIS_PROFILE``) picks the Hypothesis profile (``ci``, ``thorough``,
``quick``).  The plugin loads a profile only when one of these is given, so it does not
change other projects' Hypothesis settings.  Nothing heavy is imported until then.
"""
from __future__ import annotations

import os
import re

import pytest

_ENV = "KVABI_HYPOTHESIS_PROFILE"


def pytest_addoption(parser):
    group = parser.getgroup("kvabi", "kvabi conformance kit")
    group.addoption("--kvabi-backend", action="append", default=[], metavar="NAME",
                    help="run the kvabi conformance checks against backend NAME "
                         "(repeatable)")
    group.addoption("--kvabi-profile", default=None, metavar="PROFILE",
                    help=f"Hypothesis profile of the kvabi kit: ci (default), thorough, "
                         f"quick; also ${_ENV}")


def pytest_configure(config):
    requested = config.getoption("kvabi_profile", None)
    if requested or config.getoption("kvabi_backend", None) or os.environ.get(_ENV):
        from .profiles import load_profile

        load_profile(requested)


def pytest_report_header(config):
    names = config.getoption("kvabi_backend", None)
    if names:
        from .profiles import current_profile

        return [f"kvabi conformance: {', '.join(names)} (hypothesis profile "
                f"{current_profile()})"]
    return None


def conformance_class(name: str) -> type:
    """A :class:`BackendConformance` subclass testing backend ``name``."""
    from .conformance import BackendConformance

    ident = re.sub(r"\W", "_", name)
    return type(f"TestConformance_{ident}", (BackendConformance,),
                {"backend_name": name, "__module__": __name__,
                 "__doc__": f"kvabi conformance of backend {name!r}"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Append the conformance tests of each ``--kvabi-backend`` (before -k/-m filtering)."""
    names = config.getoption("kvabi_backend", None)
    if not names:
        return
    import sys

    module = pytest.Module.from_parent(session, path=__import__("pathlib").Path(__file__))
    # The plugin module itself holds the generated classes; the Module collector imports
    # it by path, which resolves to this already-imported module.
    this = sys.modules[__name__]
    for name in dict.fromkeys(names):
        cls = conformance_class(name)
        setattr(this, cls.__name__, cls)
        collector = pytest.Class.from_parent(module, name=cls.__name__, obj=cls)
        items.extend(session.genitems(collector))
