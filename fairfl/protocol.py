"""Client results as plain Python objects, and their wire form (ResultHeader + chunk stream).

Both transports produce `ClientResult`: the in-process one directly, the gRPC one by decoding the stream with
`ResultAssembler`, which validates everything a strategy later trusts (layout, dtype, finiteness, digest).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from google.protobuf.message import DecodeError

from fairfl import codec, framing
from fairfl.framing import CHUNK_BYTES
from fairfl.params import ParamLayout
from fairfl.v1 import common_pb2, federation_pb2, tensor_pb2

PayloadKind = int  # federation_pb2.PayloadKind value
UPDATE = federation_pb2.PAYLOAD_KIND_UPDATE
GRADIENT = federation_pb2.PAYLOAD_KIND_GRADIENT
FIRST_STEP_UPDATE = federation_pb2.PAYLOAD_KIND_FIRST_STEP_UPDATE

TRAIN = federation_pb2.PHASE_TRAIN
EVALUATE = federation_pb2.PHASE_EVALUATE
PROBE = federation_pb2.PHASE_PROBE

NAN = float("nan")
# Limits on what a result header may carry besides the payload (which the model's layout bounds exactly).
MAX_RESULT_METRICS = 64
MAX_SIGNATURE_VALUES = 1 << 16  # bias update (one value per class) and activation vectors
# Magnitude of any loss, metric or signature value: far beyond an honest one, and small enough that what strategies
# compute from them (softmax(F/τ), q-FFL's F^q, sums over a round) stays finite: one forged value cannot fail a round.
MAX_REPORTED_MAGNITUDE = 1e9
MAX_NUM_SAMPLES = (1 << 31) - 1  # sample counts weight updates; a larger one is no client's local dataset


@dataclass
class ClientResult:
    task_id: str
    run_id: str
    round: int
    client_id: int
    phase: int
    num_samples: int
    loss_before: float = NAN
    loss_after: float = NAN
    test_accuracy: float = NAN  # percent
    test_loss: float = NAN
    noisy_loss: float = NAN
    metrics: dict[str, float] = field(default_factory=dict)
    payloads: dict[PayloadKind, torch.Tensor] = field(default_factory=dict)  # flat float32, model layout
    bias_update: np.ndarray | None = None
    activation: np.ndarray | None = None
    agent_id: str = ""

    def payload_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.payloads.values())


def encode_result(
    result: ClientResult,
    layout: ParamLayout,
    chunk_bytes: int = CHUNK_BYTES,
    sha256_in_trailer: bool = False,
    framed: bool = False,
) -> Iterator[federation_pb2.ResultChunk | framing.Framed]:
    """Header first, then the payload bytes (payloads in kind order, tensors in layout order) in chunks.

    Payloads travel in `layout.payload_dtype` (the run's transport.update_dtype); a lossy cast that leaves values that
    are not finite (float16 overflows beyond ±65504) raises CodecError before anything is sent. With
    `sha256_in_trailer` the digest is computed while the chunks stream and sent after them (ResultTrailer), so a large
    update is not read once to hash it and once more to send it; otherwise it is in the header. With `framed`, the
    data chunks come serialised already (framing.Framed, for the `framing.serialize` serializer): one copy of the tensor
    memory each instead of three.
    """
    header, buffers, digest = _header_and_payload(result, layout, sha256_in_trailer)
    yield federation_pb2.ResultChunk(header=header)
    if framed:
        for views in framing.iter_chunk_views(buffers, chunk_bytes):
            yield framing.framed_data(views)
    else:
        for piece in framing.iter_byte_chunks(buffers, chunk_bytes):
            yield federation_pb2.ResultChunk(data=piece)
    if sha256_in_trailer:
        yield federation_pb2.ResultChunk(trailer=federation_pb2.ResultTrailer(sha256=digest.hexdigest()))


def encode_upload(result: ClientResult, layout: ParamLayout, with_sha256: bool = True) -> framing.Framed:
    """The serialised ResultUpload of `result` (UploadResult): header, then the payload bytes, copied once from the
    tensor memory. The header carries the payload's sha256 unless `with_sha256` is False, which only an agent on a
    mutual-TLS connection may send (TLS authenticates every byte of the one message: docs/security.md). Raises
    CodecError as encode_result does."""
    header, buffers, _ = _header_and_payload(result, layout, sha256_in_trailer=False, with_sha256=with_sha256)
    return framing.framed_header_data(header.SerializeToString(), buffers)


def result_header_and_payload(
    result: ClientResult, layout: ParamLayout
) -> tuple[federation_pb2.ResultHeader, list[memoryview]]:
    """The result's header (without a sha256) and its payload bytes, one view per payload in header order, as an
    UploadResult carries them: for a channel that authenticates and delivers every byte itself (the in-process
    transport's worker pipes). Raises CodecError as encode_result does."""
    header, buffers, _ = _header_and_payload(result, layout, sha256_in_trailer=False, with_sha256=False)
    return header, buffers


def _header_and_payload(
    result: ClientResult, layout: ParamLayout, sha256_in_trailer: bool, with_sha256: bool = True
) -> tuple[federation_pb2.ResultHeader, list[memoryview], codec.StreamDigest]:
    """The result's header, its payload bytes (views of the wire tensors) and their digest (in the header unless
    `sha256_in_trailer`, where it is still being computed on a worker thread for a large payload; none at all without
    `with_sha256`)."""
    kinds = sorted(result.payloads)
    wire = [_wire_payload(k, result.payloads[k], layout.payload_dtype) for k in kinds]
    buffers = [codec.tensor_bytes(t) for t in wire]
    total = sum(len(b) for b in buffers)
    # In a trailer, the digest is computed on a worker thread while the chunks are cut and sent (the whole payload is
    # there already); in the header, before anything is sent.
    digest = codec.StreamDigest(background=sha256_in_trailer and total >= codec.BACKGROUND_DIGEST_BYTES)
    if with_sha256 or sha256_in_trailer:
        for buf in buffers:
            digest.update(buf)
    header = federation_pb2.ResultHeader(
        task_id=result.task_id,
        run_id=result.run_id,
        round=result.round,
        client_id=result.client_id,
        phase=result.phase,  # type: ignore[arg-type]
        agent_id=result.agent_id,
        num_samples=result.num_samples,
        loss_before=result.loss_before,
        loss_after=result.loss_after,
        test_accuracy=result.test_accuracy,
        test_loss=result.test_loss,
        noisy_loss=result.noisy_loss,
        metrics=[common_pb2.Metric(name=k, value=v) for k, v in result.metrics.items()],
        payloads=[federation_pb2.Payload(kind=k, tensors=layout.specs(layout.payload_dtype)) for k in kinds],  # type: ignore[arg-type]
        total_bytes=total,
        sha256=digest.hexdigest() if with_sha256 and not sha256_in_trailer else "",
        sha256_in_trailer=sha256_in_trailer,
    )
    if result.bias_update is not None:
        header.bias_update.CopyFrom(codec.tensor_to_proto("bias_update", result.bias_update))
    if result.activation is not None:
        header.activation.CopyFrom(codec.tensor_to_proto("activation", result.activation))
    return header, buffers, digest


def _wire_payload(kind: int, flat: torch.Tensor, dtype: int) -> torch.Tensor:
    """A flat payload as the contiguous CPU tensor of its wire dtype (no copy for float32 on the CPU)."""
    flat = flat.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if dtype == tensor_pb2.DTYPE_FLOAT32:
        wire = flat.to(torch.float32).contiguous()  # no copy for a float32 payload
    else:  # into a reused buffer: a fresh one would cost more in page faults than the cast
        nbytes = flat.numel() * codec.ITEMSIZE[dtype]
        wire = torch.from_numpy(codec.TRANSFER_BUFFERS.take(nbytes)).view(codec.TORCH_DTYPES[dtype])
        wire.copy_(flat.reshape(-1))
    if dtype != tensor_pb2.DTYPE_FLOAT32 and not codec.all_finite(wire):
        name = federation_pb2.PayloadKind.Name(kind)  # type: ignore[arg-type]
        if not codec.all_finite(flat):
            raise codec.CodecError(f"{name} contains NaN or infinite values", "non_finite")
        largest = float(flat.abs().max())
        raise codec.CodecError(
            f"{name} overflows {codec.dtype_name(dtype)}: its largest magnitude is {largest:.6g}, beyond "
            f"{torch.finfo(wire.dtype).max:.6g}; set transport.update_dtype to bfloat16 or float32",
            "non_finite",
        )
    return wire


ResultPart = bytes | memoryview | federation_pb2.ResultTrailer  # what follows a ResultHeader in a result stream
# gRPC deserializer of result streams: data chunks as views of the received bytes (framing.chunk_parser).
parse_result_chunk = framing.chunk_parser(federation_pb2.ResultChunk)


@dataclass
class ReceivedUpload:
    """An UploadResult request as received: its header and payload bytes (a view of the received message), or why
    it could not be parsed (`error`; the servicer refuses it with INVALID_ARGUMENT rather than gRPC's INTERNAL)."""

    header: federation_pb2.ResultHeader
    data: memoryview | bytes
    size: int  # bytes on the wire (the gRPC metrics count them)
    error: str = ""

    def ByteSize(self) -> int:
        return self.size


def parse_result_upload(raw: bytes) -> ReceivedUpload:
    """gRPC deserializer of UploadResult: the payload as a view of the received bytes when the message is the header
    then the data (as every FairFL agent and protobuf itself write it); any other valid encoding through protobuf,
    so what is accepted is exactly what protobuf would parse."""
    try:
        parts = framing.split_header_data(raw)
        if parts is not None:
            return ReceivedUpload(federation_pb2.ResultHeader.FromString(parts[0]), parts[1], len(raw))
        message = federation_pb2.ResultUpload.FromString(raw)
    except DecodeError as err:
        return ReceivedUpload(federation_pb2.ResultHeader(), b"", len(raw), f"malformed ResultUpload: {err}")
    return ReceivedUpload(message.header, message.data, len(raw))


class ResultAssembler:
    """Decodes one ResultChunk stream against the run's model layout. Raises codec.CodecError on anything malformed."""

    def __init__(
        self,
        header: federation_pb2.ResultHeader,
        layout: ParamLayout,
        sha256_optional: bool = False,
        max_chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        """`sha256_optional`: the header may omit the payload's sha256 (UploadResult over mutual TLS); one it carries
        is checked all the same. `max_chunk_bytes`: the largest part `add` takes (a gRPC stream's chunk size; a
        channel that delivers each payload whole, as the in-process worker pipes do, passes the payload's size)."""
        self.header = header
        self.layout = layout
        kinds = [p.kind for p in header.payloads]
        if len(set(kinds)) != len(kinds):
            raise codec.CodecError("a payload kind appears twice in the result header", "layout")
        for payload in header.payloads:
            if payload.kind not in (UPDATE, GRADIENT, FIRST_STEP_UPDATE):
                raise codec.CodecError(f"unknown payload kind {payload.kind}", "layout")
            layout.check_specs(list(payload.tensors), layout.payload_dtype)
        expected = layout.payload_nbytes * len(header.payloads)
        if header.total_bytes != expected:
            raise codec.CodecError(
                f"header declares {header.total_bytes} payload bytes, the model needs {expected}", "size"
            )
        if len(header.metrics) > MAX_RESULT_METRICS:
            raise codec.CodecError(f"{len(header.metrics)} metrics in the header; at most {MAX_RESULT_METRICS}", "size")
        names = [m.name for m in header.metrics]
        if len(set(names)) != len(names):
            raise codec.CodecError("a metric name appears twice in the result header")
        bad = [m.name[:64] for m in header.metrics if not abs(m.value) <= MAX_REPORTED_MAGNITUDE]
        if bad:  # strategies and the engine read them (local_steps, train_loss)
            raise codec.CodecError(
                f"metrics {bad[:5]} are NaN, infinite or beyond ±{MAX_REPORTED_MAGNITUDE:g}", "non_finite"
            )
        self.receiver = codec.PayloadReceiver(
            header.total_bytes,
            header.sha256,
            max_bytes=expected,
            sha256_in_trailer=header.sha256_in_trailer,
            sha256_optional=sha256_optional,
            max_chunk_bytes=max_chunk_bytes,
            borrow=True,  # an UploadResult's payload is read where it arrived: payload tensors are only ever read
        )

    def add(self, part: ResultPart | bytearray, owned: bool = False) -> None:
        """The next part of the stream after the header: a data chunk's bytes, or the trailer with the sha256.
        `owned`: the caller hands the chunk's memory over (codec.PayloadReceiver.add)."""
        if isinstance(part, federation_pb2.ResultTrailer):
            self.receiver.set_trailer(part.sha256)
        else:
            self.receiver.add(part, owned)

    def finish(self) -> ClientResult:
        buffer = self.receiver.finish()
        h = self.header
        dtype = codec.TORCH_DTYPES[self.layout.payload_dtype]
        payloads: dict[int, torch.Tensor] = {}
        for i, payload in enumerate(h.payloads):
            start = i * self.layout.payload_nbytes
            wire = codec.borrowed_tensor(buffer, dtype, self.layout.numel, start)  # no copy
            if not codec.all_finite(wire):
                raise codec.CodecError(
                    f"{federation_pb2.PayloadKind.Name(payload.kind)} contains NaN or infinite values", "non_finite"
                )
            payloads[payload.kind] = wire if dtype == torch.float32 else _as_float32(wire)
        result = ClientResult(
            task_id=h.task_id,
            run_id=h.run_id,
            round=h.round,
            client_id=h.client_id,
            phase=h.phase,
            num_samples=h.num_samples,
            loss_before=h.loss_before,
            loss_after=h.loss_after,
            test_accuracy=h.test_accuracy,
            test_loss=h.test_loss,
            noisy_loss=h.noisy_loss,
            metrics={m.name: m.value for m in h.metrics},
            payloads=payloads,
            bias_update=_small_vector(h, "bias_update"),
            activation=_small_vector(h, "activation"),
            agent_id=h.agent_id,
        )
        check_result(result)
        return result


def _as_float32(wire: torch.Tensor) -> torch.Tensor:
    """A half-precision payload widened to float32 (exact), into a reusable receive buffer."""
    out = torch.from_numpy(codec.TRANSFER_BUFFERS.take(wire.numel() * 4)).view(torch.float32)
    return out.copy_(wire)


def check_result(result: ClientResult) -> None:
    """Phase-specific sanity checks every transport applies, so a diverged or hostile client is refused alike."""
    if result.num_samples > MAX_NUM_SAMPLES:
        raise codec.CodecError(f"num_samples must be at most {MAX_NUM_SAMPLES}, got {result.num_samples}", "size")
    if result.phase in (TRAIN, PROBE):
        if result.num_samples < 1:
            raise codec.CodecError("num_samples must be >= 1 for a training or probe result")
        # NaN = withheld (DP training without plaintext telemetry); check_against_task says when a loss is owed.
        for name in ("loss_before", "loss_after"):
            value = getattr(result, name)
            if not (math.isnan(value) or 0 <= value <= MAX_REPORTED_MAGNITUDE):
                raise codec.CodecError(
                    f"{name} must be a finite number >= 0 (at most {MAX_REPORTED_MAGNITUDE:g}), got {value}",
                    "non_finite",
                )
        if result.phase == PROBE and math.isnan(result.loss_before):
            raise codec.CodecError("loss_before must be a finite number >= 0 in a probe result, got nan")
    if result.phase == TRAIN:
        if UPDATE not in result.payloads:
            raise codec.CodecError("a training result must carry an UPDATE payload")
        # NaN = no loss released; a release is any finite number (noise may make it < 0)
        if not (math.isnan(result.noisy_loss) or abs(result.noisy_loss) <= MAX_REPORTED_MAGNITUDE):
            raise codec.CodecError(
                f"noisy_loss must be finite when released (at most ±{MAX_REPORTED_MAGNITUDE:g}), got "
                f"{result.noisy_loss}",
                "non_finite",
            )
    if result.phase == PROBE and result.payloads.keys() - {GRADIENT}:
        raise codec.CodecError("a probe result may carry only a GRADIENT payload")
    if result.phase == EVALUATE:
        if result.payloads:
            raise codec.CodecError("an evaluation result carries no tensor payload")
        if not 0.0 <= result.test_accuracy <= 100.0:
            raise codec.CodecError(f"test_accuracy must be a percentage in [0, 100], got {result.test_accuracy}")
        if not 0 <= result.test_loss <= MAX_REPORTED_MAGNITUDE:  # NaN compares false
            raise codec.CodecError(
                f"test_loss must be a finite number >= 0 (at most {MAX_REPORTED_MAGNITUDE:g}), got {result.test_loss}"
            )
        if result.num_samples < 1:
            raise codec.CodecError("num_samples must be >= 1 for an evaluation result")


def check_against_task(result: ClientResult, task: federation_pb2.Task) -> None:
    """The payloads a strategy will read must be exactly those the task asked for, so one client's missing or extra
    tensor is refused here instead of failing the whole round's aggregation."""
    expected: set[int] = set()
    if task.phase == TRAIN:
        expected = {UPDATE} | ({FIRST_STEP_UPDATE} if task.train.record_first_step else set())
    elif task.phase == PROBE and task.probe.want_gradient:
        expected = {GRADIENT}
    got = set(result.payloads)
    if got != expected:
        names = sorted(federation_pb2.PayloadKind.Name(k) for k in expected) or ["none"]
        sent = sorted(federation_pb2.PayloadKind.Name(k) for k in got) or ["none"]
        raise codec.CodecError(
            f"the task asks for payloads {', '.join(names)}; the result has {', '.join(sent)}", "layout"
        )
    if task.phase == TRAIN and losses_owed(task.train):
        for name in ("loss_before", "loss_after"):
            if math.isnan(getattr(result, name)):
                raise codec.CodecError(f"{name} is missing (nan); the task asks for the training losses")
    # Equitable-FL clusters on the activation vectors: a result without the one it was asked for is refused like a
    # missing payload, not left to fail the round's aggregation.
    if task.phase == TRAIN and task.train.want_activation and result.activation is None:
        raise codec.CodecError("the task asks for an activation vector; the result has none")


def losses_owed(train: federation_pb2.LocalTrainingConfig) -> bool:
    """Whether a TRAIN result must carry loss_before/loss_after: unless the task skips them (a strategy that reads
    none) or is DP-SGD without plaintext telemetry."""
    if train.HasField("dp"):
        return train.dp.plaintext_telemetry
    return not train.skip_losses


def _small_vector(header: federation_pb2.ResultHeader, field_name: str) -> np.ndarray | None:
    if not header.HasField(field_name):
        return None
    message = getattr(header, field_name)
    if len(message.spec.shape) != 1 or not 0 < message.spec.shape[0] <= MAX_SIGNATURE_VALUES:
        raise codec.CodecError(
            f"{field_name} must be a 1-D float vector of 1..{MAX_SIGNATURE_VALUES} values, got shape "
            f"{list(message.spec.shape)[:8]}",
            "layout",
        )
    tensor = codec.tensor_from_proto(message)
    if not tensor.is_floating_point():
        raise codec.CodecError(
            f"{field_name} must be a 1-D float vector, got {codec.dtype_name(message.spec.dtype)}", "layout"
        )
    array = tensor.to(torch.float64).numpy().copy()
    if not np.isfinite(array).all():
        raise codec.CodecError(f"{field_name} contains NaN or infinite values", "non_finite")
    if np.abs(array).max() > MAX_REPORTED_MAGNITUDE:
        raise codec.CodecError(f"{field_name} has values beyond ±{MAX_REPORTED_MAGNITUDE:g}", "non_finite")
    return array


def as_received(result: ClientResult, dtype: int) -> None:
    """Round a result's payloads through the wire dtype `dtype` in place, as the aggregator decodes them after an
    agent sent them in it (the in-process transport, so a lossy run matches its gRPC twin); raises codec.CodecError
    where the agent would refuse to send (float16 overflow)."""
    if dtype == tensor_pb2.DTYPE_FLOAT32:
        return
    for kind, flat in list(result.payloads.items()):
        result.payloads[kind] = _wire_payload(kind, flat, dtype).to(torch.float32)
