"""An entry point that imports fine but defines nothing for kvabi (registry tests)."""
import kvabi

VERSION = kvabi.__version__
