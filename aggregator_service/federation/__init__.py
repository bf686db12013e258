"""The gRPC federation of the aggregator: agents register, long-poll for tasks, fetch models by sha256 and stream
results back. One concept per module:

- `state`: registered agents, task queues, open phases and the blob store (FederationState);
- `admission`: the checks every result passes before it can reach a strategy (Rejected);
- `servicer`: the fairfl.v1.Federation RPC layer over the state (FederationServicer);
- `handlers`: registering the servicer with raw-bytes bulk handlers (add_federation_servicer);
- `transport`: the engine's side, dispatching a phase and waiting for its quorum (GrpcTransport).
"""
