"""``mm-serve bench``: user errors exit 2; a sweep against a fake server finds its capacity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mm_serve.cli.main import main
from tests.bench.fake_server import FakeServer


@pytest.mark.parametrize("argv, message", [
    (["--rate", "-1"], "--rate must be > 0"),
    (["--rate", "inf"], "--rate must be > 0 and < 1e+09, got inf"),
    (["--rate", "1e308", "--num-requests", "5"], "--rate must be > 0 and < 1e+09"),
    (["--rate", "1", "--duration", "nan"], "--duration must be > 0"),
    (["--sweep", "--attainment", "1.5"], "--attainment"),
    (["--sweep", "--slo-ttft", "1"], "both --slo-ttft and --slo-tpot"),
    (["--sweep", "--num-requests", "0"], "--num-requests"),
    (["--sweep", "--repeat", "0"], "--repeat must be >= 1"),
    (["--rate", "1", "--repeat", "3"], "use it with --sweep"),
    (["--rate", "1", "--server", "http://127.0.0.1:9", "--no-admission"], "start yours with it instead"),
    (["--sweep", "--server", "http://127.0.0.1:9", "--compare", "colocated"], "--compare"),
    (["--sweep", "--server", "http://127.0.0.1:9", "--workload", "llava"], "needs --model"),
    (["--sweep", "--server", "http://127.0.0.1:9", "--workload", "nope"], "unknown workload"),
    (["--sweep", "--server", "http://127.0.0.1:9"], "cannot list models"),
    (["--sweep", "--config", "/no/such.yaml"], "config file not found"),
    (["--sweep", "--model", "/no/such/dir"], "not a directory"),
    (["--rate", "1", "--server", "http://127.0.0.1:9", "--out", "/proc/nope"], "--out /proc/nope: cannot create"),
])
def test_user_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_rate_and_sweep_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--rate", "1", "--sweep"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_sweep_finds_the_capacity_of_a_fake_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One request at a time for 50 ms: 20 req/s. Near-deterministic arrivals queue only
    # above that; with 30 requests and a 0.1 s slack, 90 % pass up to ~21.6 req/s.
    with FakeServer(service_s=0.05) as server:
        status = main(["bench", "--server", server.url, "--workload", "chatbot", "--sweep",
                       "--slo-ttft", "0.15", "--slo-tpot", "1", "--num-requests", "30",
                       "--burstiness", "0.05", "--start-rate", "10", "--label", "fake",
                       "--out", str(tmp_path)])
    assert status == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    (system,) = doc["systems"]
    assert system["name"] == "fake" and 13.0 <= system["goodput"] <= 23.0
    assert doc["slo"] == {"ttft_s": 0.15, "tpot_s": 1.0, "attainment_target": 0.9}
    assert (tmp_path / "attainment.png").stat().st_size > 5000
    out = capsys.readouterr().out
    assert "goodput" in out and "fake" in out



def test_repeat_runs_the_sweep_k_times_with_other_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(service_s=0.05) as server:
        bodies = server.app.state.bodies
        status = main(["bench", "--server", server.url, "--workload", "code", "--sweep", "--repeat", "2",
                       "--slo-ttft", "0.15", "--slo-tpot", "1", "--num-requests", "30",
                       "--burstiness", "0.05", "--start-rate", "10", "--label", "fake",
                       "--out", str(tmp_path)])
    assert status == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [(s["name"], s["round"]) for s in doc["systems"]] == [("fake", 1), ("fake", 2)]
    (rep,) = doc["repeats"]
    goodputs = [s["goodput"] for s in doc["systems"]]
    assert rep["goodputs"] == goodputs and rep["low"] == min(goodputs) and rep["high"] == max(goodputs)
    assert all(13.0 <= g <= 23.0 for g in goodputs)
    # each round wrote its own records, and the rounds' content differs (LoadSpec.content_salt), so a
    # server's prefix cache cannot serve one round from another: were round 2 a replay, half the prompts
    # would repeat (a corpus window may repeat by chance, rarely)
    texts = [b["messages"][-1]["content"] for b in bodies]
    assert len(bodies) > 60 and len(set(texts)) >= 0.98 * len(texts)
    first = [json.loads(line) for line in (tmp_path / "round-1" / "records-fake.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (tmp_path / "round-2" / "records-fake.jsonl").read_text().splitlines()]
    assert first and second
    out = capsys.readouterr().out
    assert "round 2 of 2" in out and "over 2 rounds" in out


def test_a_run_where_no_request_succeeded_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(service_s=0.0, status=404) as server:
        status = main(["bench", "--server", server.url, "--workload", "chatbot", "--rate", "5", "--num-requests",
                       "4", "--slo-ttft", "1", "--slo-tpot", "1", "--label", "fake"])
    assert status == 1
    assert "no request succeeded (e.g. 'HTTP 404: " in capsys.readouterr().err


def test_a_warming_server_is_waited_for_and_a_rerun_replaces_the_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(service_s=0.01, warming_checks=2) as server:
        argv = ["bench", "--server", server.url, "--workload", "chatbot", "--rate", "5", "--num-requests", "6",
                "--slo-ttft", "1", "--slo-tpot", "1", "--label", "fake", "--out", str(tmp_path)]
        assert main(argv) == 0
        assert server.app.state.health_checks == 3  # 503, 503, then 200: measured once warm
        assert "answers 503 (starting or warming up): waiting" in capsys.readouterr().out
        first = (tmp_path / "records-fake.jsonl").read_text().splitlines()
        assert main(argv) == 0
        second = (tmp_path / "records-fake.jsonl").read_text().splitlines()
        assert len(first) == len(second) >= 6  # the second run's, not appended to the first's
        assert main([*argv, "--workload", "nosuch"]) == 2  # refused before it runs: the records stay
    assert (tmp_path / "records-fake.jsonl").read_text().splitlines() == second


@pytest.mark.parametrize(("key", "expected"), [(None, "the server wants a key: pass --api-key"),
                                               ("wrong", "a wrong key: check --api-key")])
def test_a_refused_key_is_named(key: str | None, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(service_s=0.0) as server:
        server.app.state.api_key = "sekret"
        argv = ["bench", "--server", server.url, "--rate", "1", "--num-requests", "2"]
        assert main(argv + (["--api-key", key] if key else [])) == 2
    assert f"answered 401: {expected}" in capsys.readouterr().err
