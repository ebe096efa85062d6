"""The soak's reading of a replica's /proc status."""
from scripts.bench.soak import parse_status

LIVE = "Name:\tretrace\nState:\tS (sleeping)\nVmRSS:\t  123456 kB\nThreads:\t17\n"
# What a replica killed between the sampler's poll() and its read shows: no memory lines.
ZOMBIE = "Name:\tretrace\nState:\tZ (zombie)\nThreads:\t1\n"


def test_a_live_process_gives_its_rss_fds_and_threads():
    assert parse_status(LIVE, 42) == (123456, 42, 17)


def test_an_exiting_process_gives_nothing_rather_than_killing_the_sampler():
    assert parse_status(ZOMBIE, 0) is None
