"""Small models inline in poll replies: what the aggregator puts in, and what an agent accepts from them."""

from __future__ import annotations

import logging

import pytest
import torch

from aggregator_service.federation.servicer import FederationServicer, framed_poll_reply
from aggregator_service.federation.state import FederationState
from client_agent.agent import Agent
from client_agent.trainer import ClientRuntime
from fairfl.params import flatten_parameters
from fairfl.rpc import INLINE_BLOB_BYTES
from fairfl.v1 import federation_pb2, tensor_pb2
from tests.unit.test_dp_sgd import synthetic_runtime


def _task(ref: object, client: int = 0) -> federation_pb2.Task:
    return federation_pb2.Task(task_id=f"r/r1/p0/c{client}", run_id="r", round=1, client_id=client, model=ref)


def _inline_model() -> tuple[ClientRuntime, torch.Tensor, tensor_pb2.BlobRef, federation_pb2.InlineBlob]:
    """A runtime, its initial model, that model's blob reference and the InlineBlob a poll reply carries for it."""
    runtime = synthetic_runtime()
    state = FederationState()
    x0 = flatten_parameters(runtime.model)
    ref = state.blobs.put(runtime.layout, x0)
    (blob,) = FederationServicer(state)._inline_blobs(
        federation_pb2.PollRequest(inline_blob_bytes=INLINE_BLOB_BYTES), [_task(ref)]
    )
    return runtime, x0, ref, blob


def test_a_poll_reply_inlines_each_small_model_once_and_none_the_agent_holds() -> None:
    runtime = synthetic_runtime()
    state = FederationState()
    x0 = flatten_parameters(runtime.model)
    ref = state.blobs.put(runtime.layout, x0)
    other = state.blobs.put(runtime.layout, x0 + 1)
    servicer = FederationServicer(state)
    tasks = [_task(ref, 0), _task(ref, 1), _task(other, 2)]

    blobs = servicer._inline_blobs(federation_pb2.PollRequest(inline_blob_bytes=INLINE_BLOB_BYTES), tasks)
    assert [b.header.sha256 for b in blobs] == [ref.sha256, other.sha256]
    assert torch.equal(torch.frombuffer(bytearray(blobs[0].data), dtype=torch.float32), x0)
    held = federation_pb2.PollRequest(inline_blob_bytes=INLINE_BLOB_BYTES, cached_sha256=[ref.sha256])
    assert [b.header.sha256 for b in servicer._inline_blobs(held, tasks)] == [other.sha256]
    # An agent that asks for none, or whose limit is below the model's size, fetches them instead.
    assert servicer._inline_blobs(federation_pb2.PollRequest(), tasks) == []
    small = federation_pb2.PollRequest(inline_blob_bytes=ref.total_bytes - 1)
    assert servicer._inline_blobs(small, tasks) == []
    one = federation_pb2.PollRequest(inline_blob_bytes=ref.total_bytes)  # the budget covers one model per reply
    assert len(servicer._inline_blobs(one, tasks)) == 1


def test_an_agent_caches_an_inline_model_only_when_its_digest_and_layout_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runtime, x0, ref, blob = _inline_model()
    agent = Agent("127.0.0.1:1", [0], device="cpu")
    try:
        agent.runtimes = {"r": runtime}
        corrupted = federation_pb2.InlineBlob()
        corrupted.CopyFrom(blob)
        corrupted.data = b"\x00" + blob.data[1:]
        with caplog.at_level(logging.WARNING):
            agent._take_inline("r", [corrupted])
        assert ref.sha256 not in agent.models and "refused" in caplog.text  # left to FetchBlob
        agent._take_inline("r", [blob])
        assert torch.equal(agent.models[ref.sha256], x0)
        assert torch.equal(agent._fetch_model(ref), x0)  # the task's look-up is a cache hit: no FetchBlob call
    finally:
        agent.channel.close()


def test_over_mutual_tls_an_inline_model_is_checked_for_size_and_layout_without_hashing_again() -> None:
    runtime, x0, ref, blob = _inline_model()
    agent = Agent("127.0.0.1:1", [0], device="cpu")
    agent.tls = True  # as an agent with a certificate is
    try:
        agent.runtimes = {"r": runtime}
        short, foreign = federation_pb2.InlineBlob(), federation_pb2.InlineBlob()
        short.CopyFrom(blob)
        short.data = blob.data[:-4]
        foreign.CopyFrom(blob)
        foreign.header.tensors[0].shape[0] += 1  # another model's layout
        agent._take_inline("r", [short, foreign])
        assert agent.models == {}  # both refused, left to FetchBlob
        agent._take_inline("r", [blob])
        cached = agent.models[ref.sha256]
        assert torch.equal(cached, x0)
        cached += 1  # a copy: writable, and not the reply's memory
        assert blob.data == x0.numpy().tobytes()
    finally:
        agent.channel.close()


@pytest.mark.parametrize("models", [0, 1, 2])
@pytest.mark.parametrize("with_tasks", [False, True])
def test_the_hand_framed_poll_reply_is_protobufs_encoding(models: int, with_tasks: bool) -> None:
    """PollTasks serialises its reply by hand (one copy of each inlined model); protobuf must read it as the message
    it would have built, byte for byte."""
    runtime = synthetic_runtime()
    state = FederationState()
    x0 = flatten_parameters(runtime.model)
    refs = [state.blobs.put(runtime.layout, x0 + i) for i in range(models)]
    tasks = [_task(ref, i) for i, ref in enumerate(refs)] if with_tasks else []
    bundles = [state.blobs.get(ref.sha256)[0] for ref in refs]
    framed = framed_poll_reply(tasks, bundles)
    expected = federation_pb2.PollReply(
        tasks=tasks,
        blobs=[federation_pb2.InlineBlob(header=b.header, data=b"".join(b.buffers)) for b in bundles],
    )
    assert framed.SerializeToString() == expected.SerializeToString()
    assert federation_pb2.PollReply.FromString(framed.SerializeToString()) == expected
