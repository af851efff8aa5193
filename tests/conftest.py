"""Shared fixtures: live gloo ranks on 127.0.0.1, kept for the whole session and reused."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
# The shared helpers (_ranks, _child, ...) live here; tests live in folders that mirror the package's layers
# (api/, format/, transport/, samehost/, serializing/, tools/) and a few import each other's scenarios by module
# name, as the rank pool's workers do (they get this process's sys.path): every folder goes on the path.
_FOLDERS = ("api", "format", "transport", "samehost", "serializing", "tools")
sys.path[:0] = [_HERE, *(os.path.join(_HERE, folder) for folder in _FOLDERS)]

from _ranks import close_all_pools, get_pool  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _reap_pools():
    yield
    close_all_pools()


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def ranks(request):
    """A live pool of W gloo ranks (W = 1, 2, 3, 4); reused across tests of the session."""
    return get_pool(request.param)


@pytest.fixture
def ranks3():
    return get_pool(3)


@pytest.fixture
def ranks4():
    return get_pool(4)


@pytest.fixture
def shm_dir():
    """A private directory on the shared-memory filesystem, so checks see only this test's segments."""
    path = tempfile.mkdtemp(prefix="objcomm-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)
