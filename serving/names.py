"""Names of the Serve application that the serving app and the operator share. Dependency-free: the operator
imports this module (and nothing else of serving's) without the engine, Ray or torch installed."""

APP_NAME = "cpuserve"
# what a Serve config names to build the app (build_app's args are ServeConfig fields)
IMPORT_PATH = "cpuserve.serving.app:build_app"
# The same graph as two applications (the operator's): the Ingress in APP_NAME, the LLMServer replicas in
# ENGINE_APP_NAME. A change of the engine's args then replaces only the LLMServer replicas (Serve versions every
# deployment of an application by the hash of the application's args), never the Ingress.
ENGINE_APP_NAME = "cpuserve-engine"
INGRESS_IMPORT_PATH = "cpuserve.serving.app:build_ingress_app"
ENGINE_IMPORT_PATH = "cpuserve.serving.app:build_engine_app"
SERVER_DEPLOYMENT, INGRESS_DEPLOYMENT = "LLMServer", "Ingress"
GRPC_SERVICER = "cpuserve.serving.grpc_api.add_InferenceServicer_to_server"
# a rank pod's rank, as a pod label and as its Ray node's label (operator/pods.py): a replica group's rank 0, the
# engine, goes to a rank-0 pod, the one that declares the HTTP port (serving/app.py)
RANK_LABEL = "cpuserve.dev/rank"
