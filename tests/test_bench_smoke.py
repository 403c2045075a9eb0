"""The benchmark harness runs end to end (tiny sizes: parts a, p, d and q in a few seconds; the
parts with real processes, a fake IM or a broker (o, b, f, m, k, t) as slow tests)."""

from __future__ import annotations

import pytest

from bench.run import main


def test_bench_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--only", "a,p,d,q", "--events", "300", "--seed-events", "100", "--published", "2000"]
    assert main([*argv, "--claim-rounds", "3", "--per-room-events", "300", "--per-room-slow-events", "100"]) == 0
    out = capsys.readouterr().out
    assert "a. dispatcher noop lane, batch 100" in out
    assert "a. same, claims in turn with delivery, batch 100" in out and "claims ahead = " in out
    assert "a. CPU per event in this process, batch 100" in out and "the bound without overlap: measured" in out
    assert "d. same behind 2,000 published" in out
    assert "p. PostgreSQL dispatcher noop lane, batch 100" in out
    assert "q. per_room, sink 1–10 ms, 100 ev over 50 rooms, batch 100" in out and "× unordered" in out


@pytest.mark.slow
def test_bench_ordered_processes_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part o: 1, 2 and 3 `room-outbox run` processes, per-room and unordered, ratio to one."""
    argv = ["--quick", "--only", "o", "--ordered-events", "300", "--ordered-rooms", "50", "--batches", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "o. per_room, batch 100, 50 rooms, 1 process(es)" in out
    assert "o. per_room, batch 100, 50 rooms, 3 process(es)" in out and "× 1 process" in out
    assert "o. none, batch 100, 50 rooms, 3 process(es)" in out  # the unordered lane beside it


@pytest.mark.slow
@pytest.mark.timeout(300)  # four `room-outbox run` drains, each up to the quick mode's 30 s
def test_bench_kafka_lane_and_backlog_memory_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part f: the Kafka lane beside bare aiokafka producers on tansu; part m: the RSS of
    `room-outbox run` over a backlog (noop, per_room, Kafka lane) against a reference drain."""
    argv = ["--quick", "--only", "f,m", "--kafka-events", "200", "--backlog", "1000", "--backlog-drain", "200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "f. bare aiokafka send_and_wait, 16 in flight, batch 100 (200 ev)" in out
    assert "f. Kafka lane (acks=all" in out and "of baseline" in out
    assert "f. same lane, delivery a no-op, batch 100" in out
    assert "f. this process's CPU per event: bare loop at 100 in flight, tailing lane" in out
    assert "the relay is bound by its own process's CPU" in out or "not by its CPU alone" in out
    assert "m. reference: noop lane, 200 owed" in out
    for run in ("noop lane, metrics, retention", "noop lane, per_room", "Kafka lane (a lane table)"):
        assert f"m. {run}, " in out
    assert "MB vs reference" in out and "MB per 100k ev" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_kafka_process_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part t: `room-outbox run`'s Kafka lane against the bare producer loop, rounds alternating,
    both timed from the messages' timestamps on the topic."""
    assert main(["--quick", "--only", "t", "--kafka-process-events", "500", "--kafka-process-rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "t. bare send_and_wait, 100 in flight, 500 ev (this process)" in out
    assert "t. room-outbox run, Kafka lane (relay: tail), batch 100, 500 ev over 500 rooms" in out
    assert "of bare (rounds " in out and "µs CPU/ev" in out and "≥70 % of the bare loop: " in out


@pytest.mark.slow
def test_bench_tencent_im_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part b: the sink and the main lane beside a bare loop of the sink's client (httpx on
    aiohttp's transport) and the same loop on httpx's own, in alternating rounds, each target
    printed with its verdict; the lane at the default quota with its share of a core."""
    assert main(["--quick", "--only", "b", "--im-events", "90"]) == 0
    out = capsys.readouterr().out
    assert "b. bare httpx loop, aiohttp transport → fake IM, 16 in flight (90 ev in 3 rounds)" in out
    assert "b. bare httpx loop, httpx's own transport (httpcore)" in out
    assert "b. TencentIMSink.deliver, limits lifted" in out and "of bare httpx (rounds" in out
    assert "main lane ≥90 % of bare httpx: " in out
    assert "b. main lane's CPU-bound ceiling" in out and "busy share of a core: bare" in out
    assert "b. main lane at the default quota (300 ev)" in out and "≤25 % of a core: " in out


@pytest.mark.slow
def test_bench_consume_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part k: the audit handler under the consumer engine against bare aiokafka loops on tansu,
    the ratio per round and its median."""
    assert main(["--quick", "--only", "k", "--consume-events", "300", "--consume-rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "k. bare aiokafka loop, a commit per fetched batch (300 ev, median of 2)" in out
    assert "k. consume, audit handler (effectively-once)" in out and "of per-batch loop (rounds: " in out
    assert "k. bare aiokafka loop, a commit per row (first 300 ev)" in out
