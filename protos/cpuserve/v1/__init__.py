"""cpuserve.v1: gRPC stubs generated from inference.proto by `make protos` (inference_pb2, inference_pb2_grpc)."""
