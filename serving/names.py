"""Names of the Serve application that the serving app and the operator share. Dependency-free: the operator
imports this module (and nothing else of serving's) without the engine, Ray or torch installed."""

APP_NAME = "cpuserve"
# what a Serve config names to build the app (build_app's args are ServeConfig fields)
IMPORT_PATH = "cpuserve.serving.app:build_app"
GRPC_SERVICER = "cpuserve.serving.grpc_api.add_InferenceServicer_to_server"
# a rank pod's port for its engine's vLLM-named gauges (serving/engine_metrics.py), set in the pod's environment
ENGINE_METRICS_PORT_ENV = "CPUSERVE_ENGINE_METRICS_PORT"
