"""The message of a failed checkpoint write, without a full disk (tests/dist has the real one)."""

from __future__ import annotations

import errno
import io

import torch

from lockstep.checkpoint.write_error import describe_write_failure


def test_the_os_error_behind_torchs_error_is_named_with_the_bytes(tmp_path):
    payload = {"w": torch.zeros(100)}
    try:
        try:
            raise OSError(errno.EACCES, "Permission denied")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from None
    except RuntimeError as error:
        message = describe_write_failure(tmp_path / "step_00000002.pt", payload, 1, error)
    needed = len(_saved(payload))
    assert f"step_00000002.pt in {tmp_path} failed: Permission denied (errno EACCES)" in message
    assert f"The checkpoint needs {needed:,} bytes" in message
    assert "step 1 (the one `latest` names) stays the restore point" in message


def test_an_error_without_an_os_cause_is_quoted_as_it_is(tmp_path):
    error = ValueError("something else")
    message = describe_write_failure(tmp_path / "step_00000001.pt", {}, None, error)
    assert "failed: ValueError: something else" in message
    assert "there was no committed checkpoint before it" in message


def _saved(payload) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()
