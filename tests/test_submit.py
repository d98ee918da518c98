import pytest

from vitctl.trainer.config import ConfigError
from vitctl.workflows.submit import parse_time


@pytest.mark.parametrize(("text", "minutes"), [("30", 30), ("4:00:00", 240), ("1-12", 2160), ("1-00:00:00", 1440),
                                               ("2-03:30", 3090), ("90:30", 90), ("0:30", 1)])
def test_slurm_time_formats(text, minutes):
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["abc", "0", "1:2:3:4", "-5"])
def test_bad_times_are_refused(text):
    with pytest.raises(ConfigError, match="time"):
        parse_time(text)
