"""The worker's limits: one place for their defaults and rules (service/config_limits.py),
used by WorkerConfig and by the `q6serve worker` flags (issue 18, item 5)."""

from __future__ import annotations

import pytest

from q6serve.client.cli import build_parser
from q6serve.client.cmd_worker import CONFIG_KEYS
from q6serve.kernels.errors import InvalidArgument
from q6serve.service import config_limits as lim
from q6serve.service.config import WorkerConfig, config_from

FLAGS = {  # flag -> (value given, config field, value expected)
    "--max-message-bytes": ("1MiB", "max_message_bytes", 1 << 20),
    "--max-request-bytes": ("512KiB", "max_request_bytes", 512 << 10),
    "--max-upload-bytes": ("2G", "max_upload_bytes", 2 * 10**9),
    "--max-weights": ("100", "max_weights", 100),
    "--max-inflight-rpcs": ("32", "max_inflight_rpcs", 32),
    "--max-inflight-rpcs-per-connection": ("16", "max_inflight_rpcs_per_connection", 16),
    "--min-inflight-rpcs-per-connection": ("2", "min_inflight_rpcs_per_connection", 2),
    "--max-stream-bytes": ("8MiB", "max_stream_bytes", 8 << 20),
    "--reply-timeout": ("0.5", "reply_timeout_s", 0.5),
    "--max-reading-rpcs": ("2", "max_reading_rpcs", 2),
    "--read-timeout": ("1.5", "read_timeout_s", 1.5),
    "--max-stream-bytes-per-connection": ("32MiB", "max_stream_bytes_per_connection",
                                          32 << 20),
    "--max-stream-bytes-total": ("128MiB", "max_stream_bytes_total", 128 << 20),
    "--max-streams": ("64", "max_streams", 64),
    "--max-streams-per-connection": ("8", "max_streams_per_connection", 8),
}


def worker_config(argv: list[str]) -> WorkerConfig:
    args = build_parser().parse_args(["worker", *argv])
    return config_from({k: getattr(args, k) for k in CONFIG_KEYS}, {})


def test_every_limit_flag_reaches_the_config():
    argv = [t for flag, (v, _, _) in FLAGS.items() for t in (flag, v)]
    cfg = worker_config(argv)
    for _, field, want in FLAGS.values():
        assert getattr(cfg, field) == want, field


def test_defaults_come_from_one_place_and_help_shows_them(capsys):
    cfg = worker_config([])
    assert cfg == WorkerConfig(flags=cfg.flags)
    assert (cfg.max_stream_bytes, cfg.max_inflight_rpcs, cfg.max_weights) == (
        lim.MAX_STREAM_BYTES, lim.MAX_INFLIGHT_RPCS, lim.MAX_WEIGHTS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in FLAGS:
        assert flag in text, flag
    assert f"(default {lim.show_size(lim.MAX_STREAM_BYTES_TOTAL)})" in text
    assert f"(default {lim.MAX_INFLIGHT_RPCS})" in text
    assert f"(default {lim.MAX_STREAMS})" in text
    assert f"(default {lim.show_size(lim.MAX_REQUEST_BYTES)})" in text


def test_requests_are_read_up_to_the_smaller_of_the_two_message_limits():
    assert WorkerConfig().receive_limit == lim.MAX_REQUEST_BYTES < lim.MAX_MESSAGE_BYTES
    assert WorkerConfig(max_message_bytes=1 << 20).receive_limit == 1 << 20
    assert WorkerConfig(max_request_bytes=1 << 30).receive_limit == lim.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("field,value", [("port", 65536), ("port", -1),
                                         ("metrics_port", 70000)])
def test_worker_config_checks_its_ports(field, value):
    with pytest.raises(InvalidArgument, match=r"is not a port: give 0\.\.65535"):
        WorkerConfig(**{field: value})


@pytest.mark.parametrize("argv", [["--port", "65536"], ["--metrics-port", "-5"],
                                  ["--max-stream-bytes", "0"], ["--max-stream-bytes", "lots"]])
def test_bad_values_are_one_line_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["worker", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in err and ("not a port" in err or "not a size" in err), err


@pytest.mark.parametrize("field", ["max_weights", "max_inflight_rpcs", "max_stream_bytes",
                                   "min_inflight_rpcs_per_connection", "max_message_bytes",
                                   "max_request_bytes", "max_streams",
                                   "max_streams_per_connection"])
def test_limits_below_one_are_refused(field):
    with pytest.raises(InvalidArgument, match=f"{field}=0 must be >= 1"):
        WorkerConfig(**{field: 0})


def test_get_status_shows_the_weight_limit_and_the_host_overhead():
    from q6serve.service.config import Budget
    from q6serve.service.registry import BATCHER_HOST_BYTES, WEIGHT_HOST_BYTES
    from tests.reliability.harness import RunningWorker, random_q6k

    rw = RunningWorker(WorkerConfig(port=0, vram_budget=Budget(nbytes=16 << 20),
                                    max_weights=3))
    try:
        c = rw.client()
        assert (c.status().max_weights, c.status().host_overhead_bytes) == (3, 0)
        c.upload("w", random_q6k(4, 256, 1), 4, 256)
        s = c.status()
        assert s.host_overhead_bytes == WEIGHT_HOST_BYTES + BATCHER_HOST_BYTES
        assert c.status_dict()["max_weights"] == 3
    finally:
        rw.stop()


@pytest.mark.parametrize("field", ["inline_device_us", "max_batch_delay_us"])
def test_negative_times_are_refused(field):
    with pytest.raises(InvalidArgument, match=f"{field}=-1 must be >= 0"):
        WorkerConfig(**{field: -1})
    assert getattr(WorkerConfig(**{field: 0}), field) == 0  # 0: never inline / never wait


def test_a_negative_inline_time_is_a_one_line_cli_error():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0",
                        "--backend", "numpy", "--inline-device-us", "-5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "inline_device_us=-5 must be >= 0" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
