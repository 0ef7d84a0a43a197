"""The benchmark suite keeps working: its smoke mode (tiny counts) runs every section.

Nothing here is a measurement: smoke counts are too small to mean anything, and no figure is
compared with a target. The suite's real run is ``./scripts/bench`` (see docs/performance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

KEYS = {
    "floor_commit_median_ms",
    "cli_python_pass_ms",
    "cli_help_ms",
    "cli_help_vs_python",
    "cli_jobs_list_help_ms",
    "cli_jobs_list_help_vs_python",
    "cli_jobs_list_ms",
    "cli_jobs_list_vs_python",
    "cli_jobs_show_ms",
    "cli_jobs_show_vs_python",
    "cli_worker_registered_ms",
    "step_overhead_median_ms",
    "step_overhead_vs_floor",
    "kernel_steps_per_s_conc50",
    "dbos_steps_per_s_conc50",
    "kernel_vs_dbos_conc50",
    "sizing_disk_flushes_per_s",
    "sizing_steps_per_s_2w",  # smoke runs 2 workers only, the real run 1, 2 and 4
    "agent_step_overhead_median_ms",
    "toren_runs_per_s_seq",
    "toren_runs_per_s_conc50",
    "dbos_wf_per_s_seq",
    "dbos_wf_per_s_conc50",
    "throughput_vs_dbos_conc50",
    "takeover_median_s",
    "takeover_p99_s",
    "takeover_max_s",
    "takeover_claim_p99_s",
    "replay_1000_ms",
    "fork_create_ms",
    "fork_calls",
    "fork_vs_live",
    "replay_vs_live",
    "fold_1k_ms",
    "fold_16k_ms",
    "fold_16k_vs_1k",
    "compaction_500_input_tokens",
    "nocompaction_500_input_tokens",
    "nocompaction_vs_compaction_input",
    "compaction_500_replay_ms",
    "activate_16k_step_run_ms",
    "activate_16k_from_journal_ms",
    "claim_sweep_ms_empty",
    "claim_sweep_ms_100k_sleeping",
    "claim_50_ms_no_limits",
    "claim_50_ms_limits",
    "claim_limits_ratio",
    "claim_50_ms_limits_loose",
    "claim_limits_loose_ratio",
    "schedule_firing_wal_flushes",
    "schedule_late_median_ms",
    "prune_plain_events_per_s",
    "prune_plain_delete_tx_median_ms",
    "prune_archived_events_per_s",
    "prune_archived_delete_tx_median_ms",
    "prune_archived_vs_plain",
    "prune_beside_step_median_ms",
    "prune_beside_step_median_ratio",
    "prune_beside_step_p99_ms",
    "prune_beside_step_p99_ratio",
    "api_list_by_status_ms_100k",
    "metrics_scrape_ms_100k",
    "parked_10k_leases",
    "parked_10k_actors_in_memory",
    "parked_10k_rss_delta_mb",
    "api_get_run_rps",
    "api_get_run_p99_ms",
    "api_open_loop_p99_ms",
    "api_open_loop_generator_cpu",
}
# Only where Docker and the sandbox image are (CI has both); elsewhere skipped, saying why.
SANDBOX_KEYS = {
    "sandbox_create_start_median_ms",
    "sandbox_create_start_p99_ms",
    "sandbox_bare_create_start_median_ms",
    "sandbox_create_start_vs_bare",
    "sandbox_exec_median_ms",
    "sandbox_exec_p99_ms",
    "sandbox_bare_exec_median_ms",
    "sandbox_exec_vs_bare",
    "sandbox_checkpoint_local_median_ms",
    "sandbox_checkpoint_s3_median_ms",
    "sandbox_export_vs_bare_tar",
    "sandbox_checkpoint_bytes_uploaded_max",
}
CLI_KEYS = {"sandbox_docker_run_d_median_ms", "sandbox_docker_run_rm_median_ms"}


# The smoke suite in two halves at once (each its own process and Postgres): about 65 s on a
# 2-core machine instead of 100 s in one. A section whose ratio has a baseline in another
# (kernel and agent against floor and DBOS, schedule against kernel) is in that one's half.
HALVES = (
    ("cli", "takeover", "parked", "api", "compaction", "activate", "claim"),
    (
        "floor",
        "kernel",
        "sizing",
        "dbos",
        "agent",
        "replay",
        "fork",
        "fold",
        "limits",
        "listing",
        "prune",
        "sandbox",
        "failover",
        "schedule",
    ),
)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGINT each running half's process group (the suite stops its workers and Postgres on
    its way out), SIGKILL what is left after 20 s."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGINT)
    for proc in running:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_halves_hold_every_section() -> None:
    from bench.__main__ import SECTIONS

    assert sorted(s for half in HALVES for s in half) == sorted(SECTIONS)


@pytest.mark.processes
def test_the_smoke_suite_runs_every_section_and_writes_every_key(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("wrk is missing: CI must install Debian's wrk (see .ci/run)")
        pytest.skip("wrk is not installed (apt-get install wrk): the API section needs it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    outs = [tmp_path / f"results-{i}.json" for i in range(len(HALVES))]
    logs = [tmp_path / f"bench-{i}.log" for i in range(len(HALVES))]
    procs = []
    for half, out, log in zip(HALVES, outs, logs, strict=True):
        only = [arg for name in half for arg in ("--only", name)]
        with log.open("wb") as sink:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench", "--smoke", *only, "--out", str(out)],
                    cwd=ROOT,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its workers, Postgres and wrk are stopped with it
                )
            )
    deadline = time.monotonic() + 270  # under the pytest timeout (300 s)
    try:
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        _stop(procs)
        tails = "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs
        )
        pytest.fail(f"the smoke suite did not end within 270 s:\n{tails}", pytrace=False)
    finally:
        _stop(procs)
    printed = "".join(log.read_text(errors="replace") for log in logs)
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text(errors="replace")[-6000:]
    results: dict[str, Any] = {}
    for out in outs:
        half = json.loads(out.read_text())
        assert half["postgres"]["fsync"] == "on"
        assert half["postgres"]["synchronous_commit"] == "on"
        results.update(half)
    assert results.keys() >= KEYS, sorted(KEYS - results.keys())
    assert results["smoke"] is True
    assert results["parked_10k_leases"] == 0
    assert results["parked_10k_actors_in_memory"] == 0
    assert results["fork_calls"] == 1  # a fork asks only its step again
    assert printed.count("Toren benchmarks (smoke") == len(HALVES)
    skipped = results.get("sandbox_skipped")
    if skipped is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the sandbox section was skipped: {skipped}", pytrace=False)
        print(f"the sandbox section was skipped: {skipped}")
        return
    expected = SANDBOX_KEYS | (CLI_KEYS if shutil.which("docker") else set())
    assert results.keys() >= expected, sorted(expected - results.keys())
    assert results["sandbox_containers_left"] == 0
    assert 0 < results["sandbox_checkpoint_bytes_uploaded_max"] < 64 * 1024


@pytest.mark.parametrize(
    "args",
    [
        ["--key", "api_get_run_rsp", "--min", "3300"],  # a key no section is known to measure
        ["--key", "api_get_run_rps", "--min", "3300", "--max", "1"],
        ["--key", "api_get_run_rps", "--min", "3300", "--repeat", "0"],
        ["--key", "api_get_run_rps", "--min", "many"],
    ],
)
def test_bench_bisect_misused_stops_git_bisect_instead_of_judging_the_commit_bad(
    args: list[str],
) -> None:
    # git bisect run takes any exit from 1 to 127 but 125 for "bad" and goes on; only 128 and
    # above stop it. argparse exits 2 on a usage error.
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench-bisect"), "--python", sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 128, (done.returncode, done.stderr)
    assert "error:" in done.stderr
