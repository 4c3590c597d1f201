"""The TensorBoard event file that MetricsWriter writes, read back by an independent reader: the
TFRecord framing with its masked CRC-32C checksums (computed here bit by bit, not with the
writer's own code), the version record first, a session START at the first step (what hides a
previous run's events from that step on), then one scalar per numeric metric."""

import glob
import json
import os
import struct

from tensorboardX.proto.event_pb2 import Event, SessionLog

from longctx.train.metrics import MetricsWriter


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _events(path: str) -> list[Event]:
    data, events, at = open(path, "rb").read(), [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
        assert header_crc == _masked(_crc32c(header)), f"bad length checksum at byte {at}"
        record = data[at + 12:at + 12 + length]
        (record_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert record_crc == _masked(_crc32c(record)), f"bad record checksum at byte {at}"
        events.append(Event.FromString(record))
        at += 16 + length
    return events


def _scalars(events) -> list[tuple[int, str, float]]:
    return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]


def test_event_files_read_back_and_a_resume_starts_a_new_session(tmp_path):
    writer = MetricsWriter(str(tmp_path), enabled=True)
    writer.write(1, {"loss": 2.5, "grad_norm": 1.0, "finite": True, "note": "text"})
    writer.write(2, {"loss": 2.0}, prefix="val/")
    writer.close()
    [first] = glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))
    events = _events(first)
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 1 and events[1].session_log.status == SessionLog.START
    assert _scalars(events) == [(1, "loss", 2.5), (1, "grad_norm", 1.0), (2, "val/loss", 2.0)]
    assert all(e.wall_time > 0 for e in events)

    resumed = MetricsWriter(str(tmp_path), resume_step=1, enabled=True)  # steps 2.. are trained again
    resumed.write(2, {"loss": 1.5})
    resumed.close()
    [second] = set(glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))) - {first}
    events = _events(second)
    assert events[1].step == 2 and events[1].session_log.status == SessionLog.START
    assert _scalars(events) == [(2, "loss", 1.5)]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r.get("loss", r.get("val/loss"))) for r in rows] == [(1, 2.5), (2, 1.5)]


def test_tensorboard_nan_warning_only_with_verbose(tmp_path, caplog, monkeypatch):
    """A skip run logs NaN scalars; tensorboardX warns "NaN or Inf found in input tensor." for each
    (the log line counts them already): kept out unless LONGCTX_DEBUG=1 (`--verbose`)."""
    monkeypatch.delenv("LONGCTX_DEBUG", raising=False)
    writer = MetricsWriter(str(tmp_path / "run"), enabled=True)
    with caplog.at_level("WARNING"):
        writer.write(1, {"loss": float("nan")}, prefix="train/")
    assert "NaN or Inf" not in caplog.text
    monkeypatch.setenv("LONGCTX_DEBUG", "1")
    with caplog.at_level("WARNING"):
        writer.write(2, {"loss": float("nan")}, prefix="train/")
    writer.close()
    assert caplog.text.count("NaN or Inf found in input tensor.") == 1
