"""Fixtures of the elastic group's tests."""
import pytest

from train_testing import local_cluster


@pytest.fixture
def cluster():
    """A local cluster of 2 CPUs for one test."""
    yield from local_cluster(2)
