"""pytest plugin of the conformance kit (entry point ``pytest11: kvabi``).

``pytest --kvabi-backend NAME`` (repeatable) adds the :class:`BackendConformance` tests of
each named backend to the session, as if a test file subclassed it.  ``--kvabi-profile``
(or ``$KVABI_HYPOTHESIS_PROFILE``) picks the kit's profile (``ci``, the default,
``thorough``, ``quick``) and ``--kvabi-seed`` (or ``$KVABI_SEED``) its seed, for these tests
and for ``BackendConformance`` subclasses alike.  The kit's settings never come from the
Hypothesis profile loaded in the session, and the plugin loads none, so other projects'
Hypothesis settings are left alone.  Nothing heavy is imported unless a kvabi option is
given.
"""
from __future__ import annotations

import re

import pytest

_ENV = "KVABI_HYPOTHESIS_PROFILE"


def pytest_addoption(parser):
    group = parser.getgroup("kvabi", "kvabi conformance kit")
    group.addoption("--kvabi-backend", action="append", default=[], metavar="NAME",
                    help="run the kvabi conformance checks against backend NAME "
                         "(repeatable)")
    group.addoption("--kvabi-profile", default=None, metavar="PROFILE",
                    help=f"profile of the kvabi kit: ci (default), thorough, quick; also "
                         f"${_ENV}")
    group.addoption("--kvabi-seed", default=None, metavar="SEED",
                    help="seed of the kvabi kit, an integer in [0, 2**32) (default: the "
                         "profile's; ci: 0); also $KVABI_SEED")


def pytest_configure(config):
    profile = config.getoption("kvabi_profile", None)
    seed = config.getoption("kvabi_seed", None)
    if profile or seed is not None:
        from ..util.errors import KVABIError
        from .profiles import parse_seed, select

        try:
            select(profile, None if seed is None else parse_seed(seed, "--kvabi-seed"))
        except KVABIError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    names = config.getoption("kvabi_backend", None)
    if names or config.getoption("kvabi_profile", None) or \
            config.getoption("kvabi_seed", None) is not None:
        from .profiles import kit_profile, kit_seed

        what = f"{', '.join(names)}, " if names else ""
        return [f"kvabi conformance: {what}profile {kit_profile()}, seed {kit_seed()}"]
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
