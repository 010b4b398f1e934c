"""/metrics of real sidecars after real transfers: the standard checker accepts the exposition, and
the counters read back from it hold what the traffic did."""

from __future__ import annotations

from kvsidecar.engine.stats import ReadPhase
from tests.deploy.conftest import Scrape, TransferScrapes, run


def _check_metrics(promtool: str, text: str) -> tuple[int, str]:
    result = run([promtool, "check", "metrics"], stdin=text)
    return result.returncode, (result.stdout + result.stderr).strip()


def test_promtool_accepts_the_scrapes_of_real_sidecars(
    promtool: str, transfer_scrapes: TransferScrapes
) -> None:
    for scrape in (transfer_scrapes.consumer, transfer_scrapes.producer):
        assert "kvsidecar_reads_done_total" in scrape.text
        assert _check_metrics(promtool, scrape.text) == (0, "")


def test_promtool_rejects_a_broken_exposition(
    promtool: str, transfer_scrapes: TransferScrapes
) -> None:
    """The check above can fail: one counter without `_total` and one metric without help."""
    broken = (
        transfer_scrapes.consumer.text
        + "# HELP kvsidecar_bogus A counter without its suffix.\n"
        + "# TYPE kvsidecar_bogus counter\nkvsidecar_bogus 1\n"
        + "kvsidecar_undocumented 1\n"
    )
    rc, output = _check_metrics(promtool, broken)
    assert rc != 0
    assert 'kvsidecar_bogus counter metrics should have "_total" suffix' in output
    assert "kvsidecar_undocumented no help text" in output


def test_consumer_counters_read_back_from_the_scrape(transfer_scrapes: TransferScrapes) -> None:
    """Two verified transfers, one Read rejected before posting, one refused at confirmation."""
    s: Scrape = transfer_scrapes.consumer
    done = transfer_scrapes.reads_done
    assert s.value("kvsidecar_ready") == 1
    assert s.value("kvsidecar_peer_tls") == 1
    assert s.value("kvsidecar_reads_started_total") == done + 1
    assert s.value("kvsidecar_reads_done_total") == done
    assert s.labelled("kvsidecar_reads_failed_total", "reason") == {"stale": 1}
    assert s.labelled("kvsidecar_reads_rejected_total", "code") == {"INVALID_ARGUMENT": 1}
    assert s.value("kvsidecar_read_bytes_total") == transfer_scrapes.bytes_verified
    assert s.value("kvsidecar_read_duration_seconds_count") == done
    assert s.value("kvsidecar_read_duration_seconds_bucket", le="+Inf") == done
    assert s.value("kvsidecar_read_duration_seconds_sum") > 0
    assert s.value("kvsidecar_reads_in_flight") == 0
    assert s.value("kvsidecar_handshakes_total", result="ok") == 1
    assert s.value("kvsidecar_handshakes_total", result="error") == 0
    assert s.labelled("kvsidecar_peers", "state") == {
        "handshaking": 0,
        "ready": 1,
        "quarantined": 0,
    }
    # A READ_DONE per posted read; the producer refused the one it never held.
    assert s.labelled("kvsidecar_notifications_sent_total", "kind") == {"read_done": done + 1}
    assert s.labelled("kvsidecar_notifications_refused_by_producer_total", "outcome") == {
        "unknown_request": 1
    }
    assert s.value("kvsidecar_notifications_undelivered_total") == 0
    # Every phase of every posted read was timed (confirm only for the confirmed ones); locate
    # only for reads of a staging producer, which this one is not.
    counts = s.labelled("kvsidecar_read_phase_seconds_count", "phase")
    assert set(counts) == {p.value for p in ReadPhase}
    assert counts.pop(ReadPhase.LOCATE.value) == 0
    assert all(n >= done for n in counts.values()), counts
    assert s.value("kvsidecar_session_commands_in_flight") == 0
    # Every Read call went over the engine's Session stream, the rejected one included.
    assert s.labelled("kvsidecar_session_commands_total", "kind") == {
        "read": done + 2,
        "read_batch": 0,
        "notify": 0,
        "step": 0,
        "lane_step": 0,
    }
    assert s.value("kvsidecar_registered_bytes") > 0
    assert s.value("process_cpu_seconds_total") > 0


def test_producer_counters_read_back_from_the_scrape(transfer_scrapes: TransferScrapes) -> None:
    """Two holds read and completed, one READ_DONE for a request never held, one hold expired."""
    s = transfer_scrapes.producer
    done = transfer_scrapes.reads_done
    assert s.value("kvsidecar_ready") == 1
    assert s.value("kvsidecar_sends_done_total") == done
    assert s.value("kvsidecar_leases_expired_total") == 1
    assert s.value("kvsidecar_holds_active") == 0
    assert s.value("kvsidecar_notifications_received_total") == done + 1
    assert s.labelled("kvsidecar_notifications_refused_total", "outcome") == {"unknown_request": 1}
    assert s.value("kvsidecar_stale_notifications_total") == 1
    assert s.value("kvsidecar_bad_notifications_total") == 0
    assert s.value("kvsidecar_reads_done_total") == 0
    assert s.value("kvsidecar_read_bytes_total") == 0
    assert s.value("kvsidecar_events_dropped_total") == 0
    # HOLDs are Session notify commands: the two read and the expired one.
    assert s.labelled("kvsidecar_session_commands_total", "kind") == {
        "read": 0,
        "read_batch": 0,
        "notify": done + 1,
        "step": 0,
        "lane_step": 0,
    }
