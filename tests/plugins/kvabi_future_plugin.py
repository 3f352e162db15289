"""A kvabi plugin built for a future ABI major version (registry tests: it is refused),
next to one built for a newer minor (accepted)."""
import kvabi


class FutureBackend(kvabi.Backend):
    name = "future.major"
    abi_version = (kvabi.ABI_VERSION[0] + 1, 0)


class NewerMinorBackend(kvabi.Backend):
    name = "future.minor"
    abi_version = (kvabi.ABI_VERSION[0], kvabi.ABI_VERSION[1] + 7)


@kvabi.hookimpl
def kvabi_backends():
    return [FutureBackend(), NewerMinorBackend()]
