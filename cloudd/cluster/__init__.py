"""cloudd on several replicas: Ray Serve places, restarts and autoscales engine replicas; a
fleet-aware request router keeps each robot on the replica that holds its prefixes; one front
process speaks the same ZeroMQ protocol and OpenAI API as ``cloudd serve`` and resumes a dead
replica's requests on another. Ray is an optional extra: ``pip install -e '.[cluster]'``."""
