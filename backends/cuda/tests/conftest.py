"""Test setup of kvabi-cuda: tests marked ``gpu`` run the real kernels and libraries and are
skipped without a CUDA device."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the real kernels "
                                       "(skipped without one)")


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        # This hook sees every collected item; mark only this directory's.
        if "gpu" in item.keywords and HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
