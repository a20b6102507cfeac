"""worker/push_gate.py: the mark by which a restarted sidecar knows its pod's engine took a whole push."""

from __future__ import annotations

from lorafleet.worker.push_gate import DELIVERED_MARK, delivered_here, mark_delivered


def test_the_mark_names_the_pod_that_delivered_even_in_a_cache_an_earlier_pod_left(tmp_path, monkeypatch):
    """A cache kept on the node (hostPath) holds the mark of the pod before: the next pod's delivery takes it
    over, so that its own sidecar, restarted, sees the push delivered (it kept the earlier pod's name, and the
    pod left its Service until the operator's next pass)."""
    monkeypatch.setenv("HOSTNAME", "worker-abc-pod1")
    assert not delivered_here(tmp_path)
    mark_delivered(tmp_path)
    assert delivered_here(tmp_path)
    monkeypatch.setenv("HOSTNAME", "worker-abc-pod2")  # the next pod on this node, same cache
    assert not delivered_here(tmp_path)
    mark_delivered(tmp_path)
    assert delivered_here(tmp_path) and (tmp_path / DELIVERED_MARK).read_text() == "worker-abc-pod2"
    assert [p.name for p in tmp_path.iterdir()] == [DELIVERED_MARK]  # nothing of the write left beside it
