"""A plugin whose hook lacks ``@kvabi.hookimpl`` (registry tests: pluggy ignores it, kvabi
must say so)."""
import kvabi


class UnmarkedBackend(kvabi.Backend):
    name = "unmarked.one"


def kvabi_backends():  # the decorator is missing
    return [UnmarkedBackend()]
