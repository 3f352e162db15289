"""A tiny third-party kvabi plugin, as an external package would ship it (registry tests).

It uses only kvabi's public names.
"""
import kvabi


class FakeBackend(kvabi.Backend):
    name = "fake.one"

    def available(self):
        return False, "fake: no such hardware"

    def capabilities(self, spec=None):
        return kvabi.Capabilities(kinds=("full",), dtypes=("float16",), head_dims=(64, 128),
                                  block_sizes=(16,), softcap=False, sinks=False)

    def preferred_layouts(self, spec):
        return ("flashinfer.HND",)


@kvabi.hookimpl
def kvabi_backends():
    return [FakeBackend()]
