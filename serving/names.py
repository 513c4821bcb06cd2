"""Names of the Serve application that the serving app and the operator share. Dependency-free: the operator
imports this module (and nothing else of serving's) without the engine, Ray or torch installed."""

APP_NAME = "cpuserve"
# what a Serve config names to build the app (build_app's args are ServeConfig fields)
IMPORT_PATH = "cpuserve.serving.app:build_app"
GRPC_SERVICER = "cpuserve.serving.grpc_api.add_InferenceServicer_to_server"
