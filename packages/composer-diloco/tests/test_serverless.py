"""Serverless mode with real processes: torchft's DiLoCo on ObjectStoreManager over file:// and
over s3:// (moto's S3 server on 127.0.0.1); equal to the fault-tolerant run for the same seeds."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from composer_diloco import LocalProcessExecutor, ReplicaFailedError, run_serverless

TARGET = "composer_diloco.toy:serverless_replica"
TOY_KWARGS: dict[str, Any] = {"seed": 0, "max_syncs": 2, "diloco": {"sync_every": 2}}


def _check_identical_and_equal_to(results: list[Any], reference: list[Any]) -> None:
    values = [r.value for r in results]
    assert [r.exit_code for r in results] == [0, 0]
    assert values[0]["weights"] == values[1]["weights"]
    assert values[0]["step"] == values[1]["step"] == 2
    assert values[0]["participants"] == [2, 2]
    ref = reference[0].value["weights"]
    flat = [x for p in values[0]["weights"] for x in p]
    flat_ref = [x for p in ref for x in p]
    assert max(abs(a - b) for a, b in zip(flat, flat_ref)) <= 1e-6


def test_file_store_processes_match_fault_tolerant_mode(tmp_path: Path, ft_reference: list[Any]) -> None:
    url = f"file://{tmp_path / 'store'}"
    results = run_serverless(
        LocalProcessExecutor(tmp_path / "logs"),
        TARGET,
        url=url,
        run_id="file-run",
        world_size=2,
        kwargs=TOY_KWARGS,
        timeout_s=240,
    )
    _check_identical_and_equal_to(results, ft_reference)
    assert not (tmp_path / "store" / "file-run").exists()  # the run prefix is cleaned up


def test_s3_store_processes_match_fault_tolerant_mode(
    tmp_path: Path, moto_s3: dict[str, Any], ft_reference: list[Any]
) -> None:
    run_id = f"s3-{uuid.uuid4().hex[:8]}"
    results = run_serverless(
        LocalProcessExecutor(tmp_path),
        TARGET,
        url="s3://diloco-test/runs",
        run_id=run_id,
        world_size=2,
        kwargs=TOY_KWARGS,
        storage_options=moto_s3,
        timeout_s=240,
        cleanup=False,
    )
    _check_identical_and_equal_to(results, ft_reference)
    fs = fsspec.filesystem("s3", **moto_s3)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(f"diloco-test/runs/{run_id}"))
    # only the last keep_rounds=2 rounds remain, each with 2 objects + manifest; plus one progress marker per replica
    assert names == sorted(
        ["manifest.json", "rank-00000.bin", "rank-00001.bin"] * 2 + ["rank-00000.json", "rank-00001.json"]
    )


def test_s3_conditional_put_against_moto(moto_s3: dict[str, Any]) -> None:
    from composer_diloco import ObjectStoreAllReduce

    store = ObjectStoreAllReduce(
        "s3://diloco-test/cas", uuid.uuid4().hex[:8], rank=0, world_size=1, storage_options=moto_s3
    )
    key = store.manifest_key(0)
    assert store.put_if_absent(key, b"first") is True
    assert store.put_if_absent(key, b"second") is False
    assert store.fs.cat_file(key) == b"first"


def test_replica_failure_is_reported_with_exit_code_and_log_tail(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    with pytest.raises(ReplicaFailedError) as info:
        executor.run("json:loads", [{"s": "[1, 2]"}, {"s": "{not json"}], timeout_s=60)
    ok, failed = info.value.results
    assert ok.exit_code == 0 and ok.value == [1, 2]
    assert failed.exit_code == 1 and "JSONDecodeError" in failed.log_tail
    assert "replica 1: exit code 1" in str(info.value) and "JSONDecodeError" in str(info.value)


def test_replica_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    with pytest.raises(ReplicaFailedError) as info:
        LocalProcessExecutor(tmp_path).run("subprocess:run", [{"args": ["sleep", "60"]}], timeout_s=3)
    (result,) = info.value.results
    assert result.exit_code == -9 and "killed at the deadline" in result.log_tail
    assert result.seconds < 30


def test_executor_and_launcher_validate_inputs(tmp_path: Path) -> None:
    executor = LocalProcessExecutor(tmp_path)
    with pytest.raises(ValueError, match=r"package\.module:function"):
        executor.run("json.loads", [{}])
    with pytest.raises(ValueError, match="JSON-serialisable"):
        executor.run("json:loads", [{"s": object()}])
    with pytest.raises(ValueError, match="memory://"):
        run_serverless(executor, TARGET, url="memory://x", run_id="r", world_size=2)
    with pytest.raises(ValueError, match="run_id"):
        run_serverless(executor, TARGET, url=f"file://{tmp_path}", run_id="../x", world_size=2)


def _multipart_store(moto_s3: dict[str, Any]) -> Any:
    from composer_diloco import ObjectStoreAllReduce

    store = ObjectStoreAllReduce(
        "s3://diloco-test/mpu", uuid.uuid4().hex[:8], rank=0, world_size=1, storage_options=moto_s3
    )
    store.s3_part_bytes, store.s3_parts_in_flight = 5 << 20, 2  # S3's smallest part size
    return store


def _encoded(seed: int) -> bytes:
    """A 6-part object's bytes (30 MB in parts of 5 MiB)."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(3_000_000, generator=g), torch.randn(4_500_001, generator=g)]
    return b"HEAD" * 100 + b"".join(t.numpy().tobytes() for t in tensors)


def test_s3_multipart_upload_is_create_only(moto_s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An object of 2+ parts goes up as a multipart upload (s3fs's, in parts of s3_part_bytes) whose
    completion is create-only: the object reads back byte-exact, and a second put loses."""
    store = _multipart_store(moto_s3)
    call_s3, parts = store.fs._call_s3, []

    async def tracking(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part":
            parts.append(len(kwargs["Body"]))
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", tracking)
    key, expected = store.object_key(0, 0), _encoded(0)
    assert store.put_if_absent(key, expected) is True
    assert len(parts) == 6 and sum(parts) == len(expected) and max(parts) == 5 << 20
    assert store.fs.cat_file(key) == expected
    assert store.put_if_absent(key, _encoded(1)) is False  # create-only completion
    assert store.fs.cat_file(key) == expected


def test_s3_multipart_upload_that_fails_is_aborted_and_never_visible(
    moto_s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _multipart_store(moto_s3)
    call_s3 = store.fs._call_s3

    started: list[int] = []

    async def failing(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part":
            started.append(kwargs["PartNumber"])
            if kwargs["PartNumber"] == 2:
                raise OSError("connection reset mid-part")
        return await call_s3(method, *args, **kwargs)

    monkeypatch.setattr(store.fs, "_call_s3", failing)
    key = store.object_key(0, 0)
    with pytest.raises(OSError, match="mid-part"):
        store.put_if_absent(key, _encoded(0))
    bucket, name, _ = store.fs.split_path(key)
    pending = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=name).get("Uploads", [])
    assert pending == [] and not store.fs.exists(key)
    assert 2 in started  # the failure happened mid-upload, with parts still queued
