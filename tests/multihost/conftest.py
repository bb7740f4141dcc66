"""Fixtures for multi-host tests: beds of network namespaces (testbed.py), removed after each test."""
import pytest

from testbed import Testbed, _alive


def _skip_unless_available():
    ok, why = Testbed.available()
    if not ok:
        pytest.skip(why)


def _close_and_check(bed):
    """close() must leave nothing running: every pid seen in the bed's namespaces is gone after."""
    seen = bed.pids()
    bed.close()
    assert [pid for pid in seen if _alive(pid)] == [], f"processes survived the test bed {bed.tag}"


@pytest.fixture
def make_testbed():
    """make_testbed(n, **kw) -> Testbed; every bed made is closed and checked at teardown."""
    _skip_unless_available()
    beds = []

    def make(n, **kwargs):
        bed = Testbed(n, **kwargs)
        beds.append(bed)
        return bed

    yield make
    errors = []
    for bed in beds:
        try:
            _close_and_check(bed)
        except (AssertionError, RuntimeError) as e:
            errors.append(str(e))
    assert not errors, errors


@pytest.fixture
def testbed3(make_testbed):
    return make_testbed(3)
