"""A plugin whose hook name is misspelled (registry tests: ``kvabi_backend`` is no hook)."""
import kvabi


class MisspelledBackend(kvabi.Backend):
    name = "misspelled.one"


@kvabi.hookimpl
def kvabi_backend():  # should be kvabi_backends
    return [MisspelledBackend()]
