"""FairFL: fair and private federated learning as gRPC microservices."""

__version__ = "0.1.0"
