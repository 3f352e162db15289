"""The option value types, now in :mod:`kvabi.util.argtypes` (a public module outside the
command line, so that backends' bench suites need not import :mod:`kvabi.commands`)."""
from ..util.argtypes import (directory_arg, float_arg, from_kvabi, int_arg,  # noqa: F401
                             nonnegative_int, output_file_arg, positive_int)
