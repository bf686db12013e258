"""The agent's uploader keeps the run's wire layout (its layout in transport.update_dtype) between results; a result of
another runtime or another dtype is sent in its own."""

from __future__ import annotations

import torch

from fairfl.protocol import UPDATE
from fairfl.v1 import tensor_pb2
from tests.unit.test_dp_sgd import synthetic_runtime
from tests.unit.test_result_uploads import _agent_of, _Aggregator, _result


def test_each_result_travels_in_its_own_runtimes_update_dtype() -> None:
    aggregator = _Aggregator(uploads=True)
    full, half = synthetic_runtime(), synthetic_runtime()
    half.config.transport.update_dtype = "float16"
    sent = [(full, "r/r1/p0/c0"), (full, "r/r1/p1/c0"), (half, "r/r2/p0/c0"), (full, "r/r3/p0/c0")]
    with _agent_of(aggregator) as agent:
        for runtime, task_id in sent:
            agent.uploads.submit(_result(runtime, task_id), runtime)
    assert [u.header.task_id for u in aggregator.uploads] == [task_id for _, task_id in sent]
    for upload, (runtime, task_id) in zip(aggregator.uploads, sent, strict=True):
        update = _result(runtime, task_id).payloads[UPDATE]
        if runtime is half:
            dtype, wire = tensor_pb2.DTYPE_FLOAT16, update.to(torch.float16)
        else:
            dtype, wire = tensor_pb2.DTYPE_FLOAT32, update
        assert {t.dtype for p in upload.header.payloads for t in p.tensors} == {dtype}
        assert upload.header.total_bytes == len(upload.data) == wire.numel() * wire.element_size()
        assert upload.data == wire.numpy().tobytes()
