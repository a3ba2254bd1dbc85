"""The step timeline's arithmetic on a hand-made trace: union of overlapping intervals, idle time, per-name sums."""

from benchmarks.timing import step_timeline


def test_step_timeline_counts_overlap_once_and_gaps_as_idle():
    ev = [
        {"cat": "kernel", "name": "b", "ts": 105.0, "dur": 10.0, "args": {"stream": 8, "grid": [4, 1, 1]}},
        {"cat": "kernel", "name": "a", "ts": 100.0, "dur": 10.0, "args": {"stream": 7, "grid": [1, 1, 1]}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 90.0, "dur": 100.0},  # not GPU work
        {"cat": "gpu_memset", "name": "Memset", "ts": 120.0, "dur": 5.0, "args": {"stream": 7}},
        {"cat": "kernel", "name": "a", "ts": 107.0, "dur": 2.0, "args": {"stream": 9}},  # inside both others
    ]
    t = step_timeline(ev)
    # [0, 15) busy (three overlapping kernels), [15, 20) idle, [20, 25) the memset
    assert t["wall_us"] == 25.0 and t["busy_us"] == 20.0 and t["idle_us"] == 5.0
    assert t["by_name"] == {"a": {"count": 2, "us": 12.0}, "b": {"count": 1, "us": 10.0},
                            "Memset": {"count": 1, "us": 5.0}}
    assert [k[:4] for k in t["kernels"]] == [["a", 7, 0.0, 10.0], ["b", 8, 5.0, 10.0], ["a", 9, 7.0, 2.0],
                                             ["Memset", 7, 20.0, 5.0]]
    assert t["kernels"][1][4] == [4, 1, 1]
    assert step_timeline([])["busy_us"] == 0.0
