"""Registering the Federation servicer on a gRPC server with raw-bytes bulk handlers: a stand-in server collects the
handlers the generated code makes, and the bulk methods' (de)serialisers are swapped for zero-copy ones.
"""

from __future__ import annotations

import grpc

from aggregator_service.federation.servicer import SERVICE_NAME, FederationServicer
from fairfl import framing
from fairfl.protocol import parse_result_chunk, parse_result_upload
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2


class _Registration:
    """Stands in for a grpc.Server to collect the method handlers generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def add_federation_servicer(servicer: FederationServicer, server: grpc.Server) -> None:
    """Register the Federation service as federation_pb2_grpc.add_FederationServicer_to_server does, except that the
    bulk methods handle data chunks as raw bytes: FetchBlob serialises each straight from the blob's memory, PollTasks
    the models it inlines (servicer.framed_poll_reply), and SubmitResult and UploadResult read them as views of the
    received message (framing.Framed, framing.chunk_parser, protocol.parse_result_upload). The wire format is the
    same protobuf."""
    generated = _Registration()
    federation_pb2_grpc.add_FederationServicer_to_server(servicer, generated)
    handlers = dict(generated.handlers)
    servicer.framed = True
    handlers["FetchBlob"] = grpc.unary_stream_rpc_method_handler(
        servicer.FetchBlob,
        request_deserializer=tensor_pb2.BlobRef.FromString,
        response_serializer=framing.serialize,
    )
    handlers["PollTasks"] = grpc.unary_unary_rpc_method_handler(
        servicer.PollTasks,
        request_deserializer=federation_pb2.PollRequest.FromString,
        response_serializer=framing.serialize,
    )
    handlers["SubmitResult"] = grpc.stream_unary_rpc_method_handler(
        servicer.SubmitResult,
        request_deserializer=parse_result_chunk,
        response_serializer=federation_pb2.SubmitReply.SerializeToString,
    )
    handlers["UploadResult"] = grpc.unary_unary_rpc_method_handler(
        servicer.UploadResult,
        request_deserializer=parse_result_upload,
        response_serializer=federation_pb2.SubmitReply.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
