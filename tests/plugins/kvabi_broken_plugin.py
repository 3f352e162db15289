"""A kvabi plugin that fails at import time (registry tests: it must not break kvabi)."""
raise RuntimeError("kvabi_broken_plugin: missing native library")
