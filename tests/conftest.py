"""Shared fixtures: live gloo ranks on 127.0.0.1, kept for the whole session and reused."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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
