"""ResourceAdvisor's settings: bad ones fail at construction with a message saying what to change; the YAML config
(class_path) parses."""

import pytest

from lightning_dlrover import ResourceAdvisor
from lightning_dlrover.advisor.resources import SearchSpace
from tests.conftest import REPO, run


@pytest.mark.parametrize("kwargs, message", [
    ({"profile_steps": -1}, r"profile_steps=-1\): the profiling window must be >= 0 steps"),
    ({"probe_steps": 2, "settle_steps": 2}, r"need 0 <= settle_steps < probe_steps"),
    ({"check_every_n_steps": 1}, r"check_every_n_steps=1\) must be >= 2"),
    ({"objective": "cost"}, r"needs target_samples_per_sec"),
    ({"objective": "speed"}, r"must be 'throughput' or 'cost'"),
    ({"history": "nosuchdb://host/db"}, r"history='nosuchdb://host/db'\): not a database URL SQLAlchemy can open"),
    ({"straggler_threshold": 0.9}, r"threshold=0.9 must be above 1"),
    ({"search": {"nodes": (3, 2)}}, r"SearchSpace.nodes=\(3, 2\): need 1 <= min <= max"),
])
def test_bad_settings_fail_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResourceAdvisor(**kwargs)


def test_good_settings():
    advisor = ResourceAdvisor(profile_steps=0, history=None, search={"data_workers": (0, 2)})
    assert advisor.search == SearchSpace(data_workers=(0, 2))
    assert ResourceAdvisor(history="sqlite:////tmp/x.sqlite").history_setting == "sqlite:////tmp/x.sqlite"


def test_yaml_config_with_class_path_parses(tmp_path):
    proc = run(["-m", "lightning_dlrover", "fit", "--config", REPO / "configs" / "advisor.yaml", "--print_config"],
               tmp_path, timeout=200)
    assert "class_path: lightning_dlrover.ResourceAdvisor" in proc.stdout
    assert "profile_steps: 30" in proc.stdout and "history: run" in proc.stdout
