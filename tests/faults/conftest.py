import pytest

from troupe_testing import Troupe, processes_under


@pytest.fixture
def troupe(tmp_path):
    t = Troupe(tmp_path / "troupe")
    yield t
    t.run("stop", check=False)
    assert processes_under(t.root) == [], "troupe stop left processes behind"
