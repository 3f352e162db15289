"""A backend written against ABI 1.x, as a third-party package shipped it before 2.0: its
own ``plan``/``write_kv``/``attention`` with the 1.x signatures.  The registry refuses it,
naming both versions (``specs/versioning.md``)."""
import kvabi


class Abi1Backend(kvabi.Backend):
    abi_version = (1, 2)
    name = "abi1.reference"

    def capabilities(self, spec=None):
        return kvabi.Capabilities()

    def preferred_layouts(self, spec):
        return ("flash_attn",)

    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        raise AssertionError("never called: the registry refuses this backend")

    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        raise AssertionError("never called")

    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False):
        raise AssertionError("never called")


class OverridesPlan(kvabi.Backend):
    """Declares ABI 2.0 but still runs its own plan: its checks would not be the base's."""

    name = "abi1.overrides_plan"

    def capabilities(self, spec=None):
        return kvabi.Capabilities()

    def preferred_layouts(self, spec):
        return ("flash_attn",)

    def plan(self, meta, spec, layout, **kw):
        raise AssertionError("never called")


@kvabi.hookimpl
def kvabi_backends():
    return [Abi1Backend(), OverridesPlan()]
