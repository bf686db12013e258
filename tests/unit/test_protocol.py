"""Client results on the wire: encode_result -> ResultAssembler round trips for every phase, every rejection a strategy
relies on (layout, dtype, finiteness, phase rules, digest), and the flat-parameter helpers they are built on."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pytest
import torch

from fairfl import codec
from fairfl.models import build_model
from fairfl.params import ParamLayout, flatten_parameters, load_flat
from fairfl.protocol import (
    EVALUATE,
    FIRST_STEP_UPDATE,
    GRADIENT,
    PROBE,
    TRAIN,
    UPDATE,
    ClientResult,
    ResultAssembler,
    check_against_task,
    check_result,
    encode_result,
)
from fairfl.v1 import federation_pb2, tensor_pb2

NAN = float("nan")


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", (4,), 3, hidden=(5,))


@pytest.fixture
def layout(model: torch.nn.Module) -> ParamLayout:
    return ParamLayout.of(model)


def _flat(layout: ParamLayout, seed: int) -> torch.Tensor:
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))


def train_result(layout: ParamLayout) -> ClientResult:
    return ClientResult(
        task_id="task-7",
        run_id="run-1",
        round=12,
        client_id=42,
        phase=TRAIN,
        num_samples=600,
        loss_before=2.302585092994046,
        loss_after=0.1234567890123,
        noisy_loss=2.5,
        metrics={"grad_norm": 1.25, "steps": 10.0, "lr": 0.1},
        payloads={UPDATE: _flat(layout, 1), FIRST_STEP_UPDATE: _flat(layout, 2)},
        bias_update=np.array([0.1, -0.2, 0.3], dtype=np.float32),
        activation=np.array([-1.5, -0.25, -3.0, 1e-300, 7.0], dtype=np.float64),
        agent_id="agent-a",
    )


def probe_result(layout: ParamLayout) -> ClientResult:
    return ClientResult(
        task_id="probe-1",
        run_id="run-1",
        round=3,
        client_id=5,
        phase=PROBE,
        num_samples=17,
        loss_before=0.75,
        payloads={GRADIENT: _flat(layout, 3)},
    )


def evaluate_result() -> ClientResult:
    return ClientResult(
        task_id="eval-1",
        run_id="run-1",
        round=20,
        client_id=9,
        phase=EVALUATE,
        num_samples=100,
        test_accuracy=87.5,
        test_loss=0.4,
        metrics={"per_class_min": 61.0},
    )


def assemble(chunks: Iterable[federation_pb2.ResultChunk], layout: ParamLayout) -> ClientResult:
    iterator = iter(chunks)
    first = next(iterator)
    assert first.WhichOneof("part") == "header"
    assembler = ResultAssembler(first.header, layout)
    for chunk in iterator:
        assert chunk.WhichOneof("part") == "data"
        assembler.add(chunk.data)
    return assembler.finish()


def stream(result: ClientResult, layout: ParamLayout, chunk_bytes: int = 64) -> list[federation_pb2.ResultChunk]:
    return list(encode_result(result, layout, chunk_bytes=chunk_bytes))


def with_header(chunks: list[federation_pb2.ResultChunk], header: federation_pb2.ResultHeader) -> list:
    return [federation_pb2.ResultChunk(header=header), *chunks[1:]]


def header_copy(chunks: list[federation_pb2.ResultChunk]) -> federation_pb2.ResultHeader:
    header = federation_pb2.ResultHeader()
    header.CopyFrom(chunks[0].header)
    return header


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_results_equal(got: ClientResult, want: ClientResult) -> None:
    for name in ("task_id", "run_id", "round", "client_id", "phase", "num_samples", "agent_id", "metrics"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("loss_before", "loss_after", "test_accuracy", "test_loss", "noisy_loss"):
        assert same_float(getattr(got, name), getattr(want, name)), name
    assert sorted(got.payloads) == sorted(want.payloads)
    for kind, tensor in want.payloads.items():
        assert got.payloads[kind].dtype == torch.float32
        assert torch.equal(got.payloads[kind], tensor)
    for name in ("bias_update", "activation"):
        expected, actual = getattr(want, name), getattr(got, name)
        if expected is None:
            assert actual is None
        else:
            assert actual is not None
            assert actual.dtype == np.float64
            np.testing.assert_array_equal(actual, expected.astype(np.float64))


# --- round trips ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1, 64, 1000, 2 * 1024 * 1024])
def test_train_result_roundtrip(layout: ParamLayout, chunk_bytes: int) -> None:
    original = train_result(layout)
    chunks = stream(original, layout, chunk_bytes)
    total = 2 * layout.nbytes
    assert chunks[0].header.total_bytes == total
    assert len(chunks) == 1 + math.ceil(total / chunk_bytes)
    assert all(len(c.data) <= chunk_bytes for c in chunks[1:])
    # Payloads travel in kind order, tensors in layout order.
    assert [p.kind for p in chunks[0].header.payloads] == [UPDATE, FIRST_STEP_UPDATE]
    for payload in chunks[0].header.payloads:
        assert [s.name for s in payload.tensors] == list(layout.names)
    got = assemble(chunks, layout)
    assert_results_equal(got, original)


def test_payload_bytes_are_the_flat_vectors_in_kind_order(layout: ParamLayout) -> None:
    original = train_result(layout)
    chunks = stream(original, layout)
    data = b"".join(c.data for c in chunks[1:])
    assert data == original.payloads[UPDATE].numpy().tobytes() + original.payloads[FIRST_STEP_UPDATE].numpy().tobytes()


def test_probe_result_roundtrip(layout: ParamLayout) -> None:
    original = probe_result(layout)
    got = assemble(stream(original, layout), layout)
    assert_results_equal(got, original)
    assert list(got.payloads) == [GRADIENT]


def test_probe_result_without_gradient_roundtrip(layout: ParamLayout) -> None:
    original = probe_result(layout)
    original.payloads = {}
    chunks = stream(original, layout)
    assert len(chunks) == 1
    assert_results_equal(assemble(chunks, layout), original)


def test_evaluate_result_roundtrip(layout: ParamLayout) -> None:
    original = evaluate_result()
    chunks = stream(original, layout)
    assert len(chunks) == 1
    assert chunks[0].header.total_bytes == 0
    got = assemble(chunks, layout)
    assert_results_equal(got, original)
    assert got.payloads == {}


@pytest.mark.parametrize("accuracy", [0.0, 100.0])
def test_evaluate_accuracy_bounds_are_inclusive(layout: ParamLayout, accuracy: float) -> None:
    original = evaluate_result()
    original.test_accuracy = accuracy
    assert assemble(stream(original, layout), layout).test_accuracy == accuracy


def test_signature_vectors_of_other_float_dtypes_are_accepted(layout: ParamLayout) -> None:
    original = train_result(layout)
    original.bias_update = np.array([0.5, -1.0, 2.0], dtype=np.float16)
    got = assemble(stream(original, layout), layout)
    assert got.bias_update is not None
    np.testing.assert_array_equal(got.bias_update, [0.5, -1.0, 2.0])


def test_decoded_result_survives_serialization(layout: ParamLayout) -> None:
    original = train_result(layout)
    wire = [federation_pb2.ResultChunk.FromString(c.SerializeToString()) for c in stream(original, layout)]
    assert_results_equal(assemble(wire, layout), original)


# --- rejections -----------------------------------------------------------------------------------------------------


def test_wrong_tensor_shape_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.payloads[0].tensors[0].shape[:] = list(reversed(layout.shapes[0]))  # same byte count, wrong shape
    with pytest.raises(codec.CodecError, match="shape"):
        assemble(with_header(chunks, header), layout)


def test_result_for_another_model_is_refused(layout: ParamLayout) -> None:
    other = ParamLayout.of(build_model("mlp", (4,), 3, hidden=(6,)))
    original = train_result(other)
    with pytest.raises(codec.CodecError, match="shape"):
        assemble(stream(original, other), layout)


def test_wrong_dtype_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.payloads[1].tensors[2].dtype = tensor_pb2.DTYPE_INT32  # same itemsize: only the dtype check catches it
    with pytest.raises(codec.CodecError, match="DTYPE_INT32"):
        assemble(with_header(chunks, header), layout)


def test_wrong_tensor_name_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.payloads[0].tensors[1].name = "body.1.bias_renamed"
    with pytest.raises(codec.CodecError, match="bias_renamed"):
        assemble(with_header(chunks, header), layout)


def test_missing_tensor_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    del header.payloads[0].tensors[-1]
    with pytest.raises(codec.CodecError, match="expected 4 tensors"):
        assemble(with_header(chunks, header), layout)


def test_extra_tensor_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.payloads[0].tensors.add(name="extra", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1])
    with pytest.raises(codec.CodecError, match="expected 4 tensors"):
        assemble(with_header(chunks, header), layout)


@pytest.mark.parametrize("kind", [UPDATE, FIRST_STEP_UPDATE])
@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf])
def test_non_finite_payload_is_refused(layout: ParamLayout, kind: int, bad: float) -> None:
    original = train_result(layout)
    original.payloads[kind][layout.numel - 1] = bad
    with pytest.raises(codec.CodecError, match="NaN or infinite"):
        assemble(stream(original, layout), layout)


def test_non_finite_gradient_is_refused(layout: ParamLayout) -> None:
    original = probe_result(layout)
    original.payloads[GRADIENT][0] = NAN
    with pytest.raises(codec.CodecError, match="GRADIENT"):
        assemble(stream(original, layout), layout)


@pytest.mark.parametrize("loss_after", [math.inf, -0.5])
def test_bad_train_loss_after_is_refused(layout: ParamLayout, loss_after: float) -> None:
    original = train_result(layout)
    original.loss_after = loss_after
    with pytest.raises(codec.CodecError, match="loss_after"):
        assemble(stream(original, layout), layout)


@pytest.mark.parametrize("make", [train_result, probe_result])
@pytest.mark.parametrize("loss_before", [-math.inf, -1.0])
def test_bad_loss_before_is_refused(
    layout: ParamLayout, make: Callable[[ParamLayout], ClientResult], loss_before: float
) -> None:
    original = make(layout)
    original.loss_before = loss_before
    with pytest.raises(codec.CodecError, match="loss_before"):
        assemble(stream(original, layout), layout)


def test_a_missing_loss_is_refused_unless_dp_withholds_it(layout: ParamLayout) -> None:
    probe = probe_result(layout)
    probe.loss_before = NAN
    with pytest.raises(codec.CodecError, match="loss_before must be a finite number >= 0 in a probe result"):
        assemble(stream(probe, layout), layout)
    for name in ("loss_before", "loss_after"):
        withheld = assemble(stream(replace(train_result(layout), **{name: NAN}), layout), layout)  # NaN = withheld
        task = federation_pb2.Task(phase=TRAIN)
        task.train.local_steps = 1
        task.train.record_first_step = True  # train_result carries a FIRST_STEP_UPDATE too
        with pytest.raises(codec.CodecError, match=f"{name} is missing"):
            check_against_task(withheld, task)  # a plain training task owes both losses
        task.train.dp.sample_rate = 0.1
        check_against_task(withheld, task)  # DP-SGD without plaintext telemetry withholds them
        task.train.dp.plaintext_telemetry = True
        with pytest.raises(codec.CodecError, match=f"{name} is missing"):
            check_against_task(withheld, task)
        task.train.ClearField("dp")
        task.train.skip_losses = True  # the strategy reads no F_i: the passes were skipped
        check_against_task(withheld, task)


@pytest.mark.parametrize("accuracy", [120.0, -0.1, NAN])
def test_test_accuracy_outside_percent_range_is_refused(layout: ParamLayout, accuracy: float) -> None:
    original = evaluate_result()
    original.test_accuracy = accuracy
    with pytest.raises(codec.CodecError, match="test_accuracy"):
        assemble(stream(original, layout), layout)


@pytest.mark.parametrize("test_loss", [NAN, math.inf, -1.0])
def test_bad_test_loss_is_refused(layout: ParamLayout, test_loss: float) -> None:
    original = evaluate_result()
    original.test_loss = test_loss
    with pytest.raises(codec.CodecError, match="test_loss"):
        assemble(stream(original, layout), layout)


def test_phase_payload_rules(layout: ParamLayout) -> None:
    no_update = train_result(layout)
    del no_update.payloads[UPDATE]
    with pytest.raises(codec.CodecError, match="UPDATE"):
        assemble(stream(no_update, layout), layout)

    probe_with_update = probe_result(layout)
    probe_with_update.payloads[UPDATE] = _flat(layout, 9)
    with pytest.raises(codec.CodecError, match="only a GRADIENT"):
        assemble(stream(probe_with_update, layout), layout)

    evaluate_with_payload = evaluate_result()
    evaluate_with_payload.payloads = {UPDATE: _flat(layout, 10)}
    with pytest.raises(codec.CodecError, match="no tensor payload"):
        assemble(stream(evaluate_with_payload, layout), layout)


@pytest.mark.parametrize("make", [train_result, probe_result, lambda _layout: evaluate_result()])
def test_zero_samples_is_refused(layout: ParamLayout, make: Callable[[ParamLayout], ClientResult]) -> None:
    original = make(layout)
    original.num_samples = 0
    with pytest.raises(codec.CodecError, match="num_samples"):
        assemble(stream(original, layout), layout)


def test_duplicate_payload_kind_is_refused(layout: ParamLayout) -> None:
    original = train_result(layout)
    original.payloads = {UPDATE: _flat(layout, 1)}
    chunks = stream(original, layout)
    header = header_copy(chunks)
    header.payloads.add().CopyFrom(header.payloads[0])
    header.total_bytes = 2 * layout.nbytes
    data = chunks[1:] + chunks[1:]
    with pytest.raises(codec.CodecError, match="appears twice"):
        assemble([federation_pb2.ResultChunk(header=header), *data], layout)


def test_unknown_payload_kind_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.payloads[1].kind = 7  # type: ignore[assignment]
    with pytest.raises(codec.CodecError, match="unknown payload kind"):
        assemble(with_header(chunks, header), layout)


@pytest.mark.parametrize("delta", [-4, 4, 1])
def test_total_bytes_mismatch_is_refused(layout: ParamLayout, delta: int) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.total_bytes += delta
    with pytest.raises(codec.CodecError, match="payload bytes"):
        assemble(with_header(chunks, header), layout)


def test_corrupted_data_fails_the_digest(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    index = len(chunks) // 2
    data = bytearray(chunks[index].data)
    data[0] ^= 0x10  # a flipped mantissa bit: still finite, only the digest can tell
    tampered = [*chunks[:index], federation_pb2.ResultChunk(data=bytes(data)), *chunks[index + 1 :]]
    with pytest.raises(codec.CodecError, match="sha256"):
        assemble(tampered, layout)


def test_reordered_data_fails_the_digest(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    tampered = [chunks[0], chunks[2], chunks[1], *chunks[3:]]
    with pytest.raises(codec.CodecError, match="sha256"):
        assemble(tampered, layout)


def test_truncated_and_overlong_streams_are_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    with pytest.raises(codec.CodecError, match="ended after"):
        assemble(chunks[:-1], layout)
    with pytest.raises(codec.CodecError, match="declared"):
        assemble([*chunks, federation_pb2.ResultChunk(data=b"\x00\x00\x00\x00")], layout)


@pytest.mark.parametrize("field_name", ["bias_update", "activation"])
@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_non_finite_signature_vector_is_refused(layout: ParamLayout, field_name: str, bad: float) -> None:
    original = train_result(layout)
    vector = getattr(original, field_name).copy()
    vector[1] = bad
    setattr(original, field_name, vector)
    with pytest.raises(codec.CodecError, match=field_name):
        assemble(stream(original, layout), layout)


@pytest.mark.parametrize("vector", [np.zeros((3, 1), dtype=np.float32), np.array([1, 2, 3], dtype=np.int32)])
def test_signature_vector_must_be_1d_float(layout: ParamLayout, vector: np.ndarray) -> None:
    original = train_result(layout)
    original.bias_update = vector
    with pytest.raises(codec.CodecError, match="bias_update must be a 1-D float vector"):
        assemble(stream(original, layout), layout)


def test_scalar_signature_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.activation.CopyFrom(codec.tensor_to_proto("activation", torch.tensor(1.0)))
    with pytest.raises(codec.CodecError, match="activation must be a 1-D float vector"):
        assemble(with_header(chunks, header), layout)


def test_signature_vector_with_wrong_data_length_is_refused(layout: ParamLayout) -> None:
    chunks = stream(train_result(layout), layout)
    header = header_copy(chunks)
    header.bias_update.data = header.bias_update.data[:-1]
    with pytest.raises(codec.CodecError, match="bias_update"):
        assemble(with_header(chunks, header), layout)


def test_check_result_applies_to_in_process_results(layout: ParamLayout) -> None:
    check_result(train_result(layout))
    check_result(probe_result(layout))
    check_result(evaluate_result())
    bad = train_result(layout)
    bad.loss_after = -1.0
    with pytest.raises(codec.CodecError, match="loss_after"):
        check_result(bad)


def test_payload_bytes(layout: ParamLayout) -> None:
    assert train_result(layout).payload_bytes() == 2 * layout.numel * 4
    assert evaluate_result().payload_bytes() == 0


# --- flat parameters ------------------------------------------------------------------------------------------------


def test_layout_describes_the_model(model: torch.nn.Module, layout: ParamLayout) -> None:
    assert layout.names == ("body.1.weight", "body.1.bias", "classifier.weight", "classifier.bias")
    assert layout.shapes == ((5, 4), (5,), (3, 5), (3,))
    assert layout.sizes == (20, 5, 15, 3)
    assert layout.numel == 43 == sum(p.numel() for p in model.parameters())
    assert layout.nbytes == 43 * 4
    specs = layout.specs()
    layout.check_specs(specs)
    assert [(s.name, s.dtype, tuple(s.shape)) for s in specs] == [
        (n, tensor_pb2.DTYPE_FLOAT32, s) for n, s in zip(layout.names, layout.shapes, strict=True)
    ]


def test_flatten_split_load_roundtrip(model: torch.nn.Module, layout: ParamLayout) -> None:
    flat = flatten_parameters(model)
    assert flat.dtype == torch.float32
    assert flat.shape == (layout.numel,)
    named = dict(model.named_parameters())
    parts = layout.split(flat)
    assert [n for n, _ in parts] == list(layout.names)
    for name, part in parts:
        assert torch.equal(part, named[name].detach())

    other = build_model("mlp", (4,), 3, hidden=(5,))
    new_flat = _flat(layout, 11)
    load_flat(other, new_flat)
    assert torch.equal(flatten_parameters(other), new_flat)
    for (name, part), (pname, param) in zip(layout.split(new_flat), other.named_parameters(), strict=True):
        assert name == pname
        assert torch.equal(param.detach(), part)


def test_split_returns_views_of_the_flat_vector(layout: ParamLayout) -> None:
    flat = _flat(layout, 12)
    parts = dict(layout.split(flat))
    parts["classifier.bias"][0] = 99.0
    assert flat[layout.numel - 3].item() == 99.0


def test_load_flat_does_not_alias_the_source(model: torch.nn.Module, layout: ParamLayout) -> None:
    source = _flat(layout, 13)
    snapshot = source.clone()
    load_flat(model, source)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.equal(source, snapshot)
    source.zero_()
    assert torch.equal(flatten_parameters(model), snapshot + 1.0)


def test_load_flat_from_a_received_buffer_does_not_alias_it(model: torch.nn.Module, layout: ParamLayout) -> None:
    # The agent loads models straight from a receive buffer that its cache keeps: training must not write into it.
    flat = _flat(layout, 14)
    bundle = layout.encode(flat)
    _, decoded = codec.receive_bundle(bundle.chunks())
    received = torch.cat([t.reshape(-1) for _, t in decoded])
    buffer_view = decoded[0][1]
    before = buffer_view.clone()
    load_flat(model, received)
    with torch.no_grad():
        next(model.parameters()).mul_(-3.0)
    assert torch.equal(buffer_view, before)


def test_flatten_parameters_is_a_copy(model: torch.nn.Module) -> None:
    flat = flatten_parameters(model)
    snapshot = flat.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert torch.equal(flat, snapshot)


def test_layout_encode_is_the_model_bundle(model: torch.nn.Module, layout: ParamLayout) -> None:
    flat = flatten_parameters(model)
    header, decoded = codec.receive_bundle(layout.encode(flat).chunks())
    layout.check_specs(list(header.tensors))
    assert [n for n, _ in decoded] == list(layout.names)
    named = dict(model.named_parameters())
    for name, tensor in decoded:
        assert torch.equal(tensor, named[name].detach())


@pytest.mark.parametrize("delta", [-1, 1])
def test_load_flat_refuses_a_vector_of_the_wrong_size(model: torch.nn.Module, layout: ParamLayout, delta: int) -> None:
    # Fails today for delta=-1: a too-short vector dies in view_as with a RuntimeError ("shape '[3]' is invalid for
    # input of size 2") before load_flat's own size check (ValueError) is reached.
    with pytest.raises(ValueError, match="flat vector has"):
        load_flat(model, torch.zeros(layout.numel + delta))
